"""Train with LightningCLI.

python train.py fit --config configs/ppo_adaptive.yaml
python train.py fit --config configs/ppo_fixed.yaml
python train.py fit --config configs/sft.yaml
python train.py fit --config configs/ppo_adaptive.yaml --print_config
"""

from rlkl_lightning.cli import main

if __name__ == "__main__":
    main()
