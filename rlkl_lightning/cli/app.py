"""The LightningCLI of rlkl_lightning: ``python train.py fit --config configs/ppo_adaptive.yaml``.

Beside Lightning's ``model``, ``data`` and ``trainer`` groups the CLI has a ``kl`` group: the
KL target is given there once and shared by the controller and the drift monitor, whose
callbacks the CLI adds to the trainer. The initial beta is the module's ``kl_coef`` when the
trainer is built (``model.init_args.penalty.init_coef`` for this package's modules).

Checkpoints are not trusted (docs/checkpoints.md): every subcommand restores with
``weights_only=True``, ``--ckpt_path`` is checked before anything loads it, and no setting is
taken from a checkpoint.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    ModelCheckpoint,
    OnExceptionCheckpoint,
    ProgressBar,
    RichProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

from rlkl_lightning.algorithms.options import MODULE_GROUPS, as_group
from rlkl_lightning.algorithms.pipeline import RLPipeline
from rlkl_lightning.checkpoints import (
    AfterLoggingCheckpoint,
    AtomicCheckpointIO,
    check_checkpoint,
    first_resumed_step,
    newest_last_checkpoint,
)
from rlkl_lightning.cli.collective_timeout import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    OPTION,
    apply_collective_timeout,
    check_collective_timeout,
    timeout_message,
)
from rlkl_lightning.cli.help import HelpfulParser
from rlkl_lightning.cli.run_end import ExtendFinishedEpoch, SaveLastAtEnd
from rlkl_lightning.cli.run_settings import RunSettings, trajectory_settings
from rlkl_lightning.components import import_object, plain_spec
from rlkl_lightning.console import RunProgressBar, quiet_lightning_notes, quiet_resume_notes
from rlkl_lightning.data.prompts import PromptDataModule, options_problem
from rlkl_lightning.errors import VERBOSE_ENV, user_message
from rlkl_lightning.kl.laws import LAWS
from rlkl_lightning.kl.settings import KLSettings, moved_gain
from rlkl_lightning.migrations import MODULE_PREFIX, moved_option, renamed_group

#: The module's group of the KL penalty (``KLPenalty``).
PENALTY = "penalty"


class RLKLCLI(LightningCLI):
    """LightningCLI with the ``kl`` group; any LightningModule with ``kl_coef`` gets KL control.

    Beyond Lightning's CLI:

    * ``fit --ckpt_path last`` resumes the latest run of the logger's ``save_dir``/``name``:
      the newest ``last*.ckpt`` of its ``version_*/checkpoints`` directories, where a
      ``ModelCheckpoint`` without ``dirpath`` saves (Lightning alone would look only in the new,
      empty version directory of this start and train from scratch). The logger continues in
      the resumed run's version directory; TensorBoard drops what the killed run logged after
      that checkpoint (``purge_step``). With nothing to resume the run stops with an error that
      says where it looked;
    * checkpoint files are replaced atomically (:class:`~rlkl_lightning.checkpoints.
      AtomicCheckpointIO`), unless ``trainer.plugins`` names another ``CheckpointIO``;
    * ``trainer.enable_checkpointing: false`` also drops the ``ModelCheckpoint`` callbacks a
      config lists (Lightning would refuse the combination);
    * the progress bar counts the batches of the run, and stock notes that do not apply to RL
      runs are hidden (:mod:`rlkl_lightning.console`);
    * a resume whose settings change the trajectory (KL law, target, horizon, model, batch
      size, ...) is refused with the differences listed, unless ``--resume_with_changes true``
      (:class:`~rlkl_lightning.cli.run_settings.RunSettings`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        quiet_lightning_notes()
        self._searched: list[str] = []  # where `--ckpt_path last` looked across versions
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any):
        """A parser that raises its errors, for :func:`main` to print them alone (no usage dump)."""
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        """Add the ``kl`` group, ``--resume_with_changes`` and ``--collective_timeout``."""
        parser.add_class_arguments(KLSettings, "kl", sub_configs=True)  # `kl: base/kl.yaml`
        parser.add_argument(
            "--resume_with_changes",
            type=bool,
            default=False,
            help="Resume although the settings that shape the trajectory (KL law, target, "
            "horizon, model, batch size, ...) differ from the checkpoint's: the callbacks' "
            "states are carried over and the changes printed (default: refuse, listing them).",
        )
        parser.add_argument(
            OPTION,
            type=float,
            default=DEFAULT_COLLECTIVE_TIMEOUT_S,
            help="Seconds a rank waits at a collective for its peers before the run stops with "
            "a line naming the rank (several processes; a strategy's own `timeout` wins).",
        )

    def before_instantiate_classes(self) -> None:
        """With ``fit --ckpt_path last``, log into the version directory of the run resumed.

        Applies to a logger with ``save_dir``, ``name`` and ``version`` (``TensorBoardLogger``,
        ``CSVLogger``) whose ``version`` is not set; of a list of loggers, to the first, under
        whose directory Lightning saves the checkpoints. With its ``version`` set, only
        TensorBoard's ``purge_step`` is set (the events a killed run logged after its
        checkpoint are dropped). The checkpoint is checked here, before any
        model loads. A logger whose package is missing stops the run first, naming the extra, and
        so does a component the config names that does not import or does not take its
        arguments (:meth:`_check_components`): before any weights load.
        """
        _check_logger_packages(self._get(self.config, "trainer").get("logger"))
        check_collective_timeout(self._get(self.config, "collective_timeout"))  # before weights
        self._check_components()
        if self.subcommand != "fit" or self._get(self.config, "ckpt_path") != "last":
            return
        logger = self._get(self.config, "trainer").get("logger")
        if isinstance(logger, list):  # checkpoints go under the first logger's directory
            logger = logger[0] if logger else None
        init = getattr(logger, "init_args", None)
        if init is None or not {"save_dir", "name", "version"} <= set(vars(init)):
            return
        root = Path(init.save_dir) / (init.name or "")
        if init.version is not None:  # Lightning looks in that version's directory itself
            named = init.version if isinstance(init.version, str) else f"version_{init.version}"
            found = newest_last_checkpoint(root, named)
        else:
            self._searched.append(str(root / "version_*" / "checkpoints"))
            found = newest_last_checkpoint(root)
        if found is None:
            return  # before_fit says where it looked
        checkpoint = check_checkpoint(found)
        if init.version is None:
            version = found.parent.parent.name
            number = version.removeprefix("version_")
            init.version = int(number) if number.isdigit() else version
        step = first_resumed_step(checkpoint)
        if "purge_step" in vars(init) and step is not None:
            init.purge_step = step  # TensorBoard: drop events the killed run logged after it

    def parse_arguments(self, parser, args) -> None:
        """Parse; with ``--print_config``, check the components first, then print.

        The parser prints the config while it parses, before any check of this package: a
        misspelt law would be printed as if it were one. The arguments are parsed once without
        ``--print_config`` and checked (:meth:`_check_components`), then as given.
        """
        given = sys.argv[1:] if args is None else args
        if isinstance(given, list):
            printing = [a for a in given if str(a).partition("=")[0] == "--print_config"]
            if printing:
                rest = [a for a in given if a not in printing]
                parsed = parser.parse_args(rest)
                self._check_components(parsed.get(str(parsed.get("subcommand")), parsed))
        super().parse_arguments(parser, args)

    def _check_components(self, config: Any = None) -> None:
        """Build the module's option groups and the KL law once, before the model loads.

        Building the module loads the policy's weights (minutes for a large one); a group's
        bad value, a group block that is not a mapping (``sampling:`` left empty), more
        minibatches than a batch has rows (:func:`_check_module_groups`), a misspelt
        ``kl.controller`` or a gain out of range are reported first, as the group's or the
        law's. The module's own components (the KL estimators, the advantage) are checked by
        their groups.

        Args:
            config: The subcommand's parsed config (default: this run's).
        """
        config = (
            config if config is not None else self.config.get(str(self.subcommand), self.config)
        )
        model = config.get("model")
        _check_data(config.get("data"))
        _check_module_groups(model, config.get("data"))
        kl = config.get("kl")
        if kl is None:
            return
        values = kl.as_dict() if hasattr(kl, "as_dict") else dict(kl)
        # `kl: my_kl.yaml` adds the parser's `__path__` (the file) beside the group's fields
        settings = KLSettings(**{k: v for k, v in values.items() if not k.startswith("__")})
        init = getattr(model, "init_args", None)
        penalty = None
        for group in ("penalty", "kl"):  # the module's KL group (its name since 0.5.0 first)
            penalty = penalty or (getattr(init, group, None) if init is not None else None)
        init_coef = getattr(penalty, "init_coef", None)
        if isinstance(init_coef, int | float) and not isinstance(init_coef, bool):
            settings.callbacks(float(init_coef))  # the law's checks, the callbacks' (monitor)

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """Build the trainer, then put the KL callbacks first (checkpointing stays last).

        Two callbacks of :mod:`~rlkl_lightning.cli.run_end` are added: ``last.ckpt`` is written
        after the run's final batch, and a run under ``max_steps`` extended from a finished
        epoch trains the next one.

        Lightning's default progress bar is swapped for :class:`~rlkl_lightning.console.
        RunProgressBar`; a progress bar given in ``trainer.callbacks`` is kept. Lightning's
        default ``CheckpointIO`` is swapped for :class:`~rlkl_lightning.checkpoints.
        AtomicCheckpointIO`, and a plain ``ModelCheckpoint`` for :class:`~rlkl_lightning.
        checkpoints.AfterLoggingCheckpoint` (written after the batch's logging and validation).
        """
        config = self._get(self.config_init, "trainer", default={})
        if config.get("enable_checkpointing") is False and config.get("callbacks"):
            config["callbacks"] = [
                c for c in config["callbacks"] if not isinstance(c, ModelCheckpoint)
            ]
        # Before the trainer exists: Lightning adds its own callbacks to the configured list.
        configured_bar = any(isinstance(c, ProgressBar) for c in config.get("callbacks") or [])
        trainer = super().instantiate_trainer(**kwargs)
        run = self.config[self.subcommand] if self.subcommand else self.config
        apply_collective_timeout(trainer.strategy, run.get("collective_timeout"))
        if not configured_bar:
            for i, callback in enumerate(trainer.callbacks):
                if type(callback) in (RichProgressBar, TQDMProgressBar):  # Lightning's default
                    trainer.callbacks[i] = RunProgressBar()
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        for i, callback in enumerate(trainer.callbacks):  # written after the batch's logging
            if type(callback) is ModelCheckpoint:
                trainer.callbacks[i] = AfterLoggingCheckpoint.replacing(callback)
        init_kl_coef = getattr(self.model, "kl_coef", None)
        kl_callbacks = []
        if init_kl_coef is not None:
            kl: KLSettings = self._get(self.config_init, "kl")
            kl_callbacks = kl.callbacks(float(init_kl_coef))
        config = self.config[self.subcommand] if self.subcommand else self.config
        allow = bool(config.get("resume_with_changes"))
        guard = RunSettings(trajectory_settings(config), allow)  # has no batch hooks
        trainer.callbacks[:0] = [*kl_callbacks, guard, ExtendFinishedEpoch()]
        trainer.callbacks.append(SaveLastAtEnd())  # after the ModelCheckpoint callbacks
        return trainer

    def _parse_ckpt_path(self) -> None:
        """Open checkpoints with ``weights_only=True``, check ``--ckpt_path``, take no settings.

        LightningCLI would read a checkpoint's hyperparameters into the model's config, its
        ``class_path`` included; a checkpoint is not trusted (docs/checkpoints.md), so the config
        alone builds the model. The subcommand's ``weights_only`` is set to True (Lightning
        restores with it; ``false`` is refused), and a ``--ckpt_path`` file is checked before
        anything loads it (``last`` in :meth:`before_fit`, once resolved).

        Overrides LightningCLI's (private) step that runs right after the arguments are parsed;
        ``tests/system/test_untrusted_files.py`` fails if Lightning stops calling it.
        """
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        if config.get("weights_only") is False:
            raise ValueError(
                "`weights_only` must be true or unset: checkpoints are opened without running "
                "code from them (docs/checkpoints.md, 'Security')"
            )
        config["weights_only"] = True
        path = config.get("ckpt_path")
        if subcommand == "fit" and path == "best":  # Lightning's error blamed the config
            raise ValueError(
                "`--ckpt_path best` names the best checkpoint of an earlier `fit` in the same "
                "process, which a new run has not had; allowed: `last` (the latest run of this "
                "config) or a checkpoint file (`--ckpt_path PATH`)"
            )
        named = str(path).partition(":")[0] in ("last", "best", "hpc", "registry")
        if path is not None and not named:
            check_checkpoint(path)

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path last`` (an error if there is nothing), check the file.

        The file Lightning will load (a path, or ``last`` once resolved) is checked before
        anything loads it, and the settings it was written with are compared with this run's
        (:class:`~rlkl_lightning.cli.run_settings.RunSettings`).
        """
        path = self._get(self.config_init, "ckpt_path")
        if path == "last":
            path = _last_checkpoint(self.trainer)
            if path is None:
                raise ValueError(_nothing_to_resume(self.trainer, self._searched))
        if path is None:
            return
        quiet_resume_notes()
        if path in ("best", "hpc", "registry"):
            return
        # Checked again if checked before (memory-mapped: cheap): its settings are compared
        # here, before Lightning restores anything or the run's config.yaml is rewritten.
        checkpoint = check_checkpoint(path)
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunSettings):
                callback.compare(checkpoint)


def _check_data(data: Any) -> None:
    """Refuse a :class:`~rlkl_lightning.data.prompts.PromptDataModule` option it would refuse.

    The data module is built after the model's weights load; its error named the class, not
    the option (``data.init_args.batch_size``). A subclass checks its own arguments.
    """
    init = getattr(data, "init_args", None)
    try:
        cls = import_object(str(getattr(data, "class_path", "")))
    except (ImportError, AttributeError, ValueError):
        return  # the parser names a class that does not import
    if init is None or cls is not PromptDataModule:
        return
    given = init.as_dict() if isinstance(init, Namespace) else dict(init)
    problem = options_problem(given, "`data.init_args.{}`".format)
    if problem is not None:
        raise ValueError(problem)


def _check_module_groups(model: Any, data: Any) -> None:
    """Build each option group of this package's module from the config, raising its error.

    jsonargparse builds the groups only with the module: a block that is not a mapping
    (``sampling:`` with every key commented out is ``null``) ended in two tracebacks that
    never named it, and ``--print_config`` printed a value the group refuses. A batch with
    fewer rows (``data.batch_size``, times ``group.responses_per_prompt``) than
    ``optimization.num_minibatches`` is refused too (:meth:`~rlkl_lightning.algorithms.
    options.Optimization.rows_problem`).
    """
    init = getattr(model, "init_args", None)
    try:
        module = import_object(str(getattr(model, "class_path", "")))
    except (ImportError, AttributeError, ValueError):
        return  # the parser names a class that does not import
    if init is None or not (isinstance(module, type) and issubclass(module, RLPipeline)):
        return
    groups = {}
    parameters = inspect.signature(module).parameters
    for name, cls in MODULE_GROUPS.items():
        # A subclass may take a group's name as an argument of its own (a dict, None, ...).
        if name in init and name in parameters and isinstance(parameters[name].default, cls):
            value = init[name]
            value = value.as_dict() if isinstance(value, Namespace) else value
            groups[name] = as_group(cls, value, f"{MODULE_PREFIX}{name}")
    optimization = groups.get("optimization")
    batch_size = getattr(getattr(data, "init_args", None), "batch_size", None)
    if optimization is None or type(batch_size) is not int or batch_size < 1:
        return  # the data module names a batch size it refuses
    rows, counted = batch_size, "data.init_args.batch_size"
    if "group" in groups:
        rows *= groups["group"].responses_per_prompt
        counted += " x model.init_args.group.responses_per_prompt"
    problem = optimization.rows_problem(rows, counted)
    if problem is not None:
        raise ValueError(problem)


# Logger class -> (the module it needs, the rlkl_lightning extra that installs it, or None).
LOGGER_PACKAGES = {
    "MLFlowLogger": ("mlflow", "mlflow"),
    "WandbLogger": ("wandb", "wandb"),
    "CometLogger": ("comet_ml", None),
    "NeptuneLogger": ("neptune", None),
}


def _check_logger_packages(logger: Any) -> None:
    """Refuse a logger whose package is missing in one line that names the extra to install.

    Lightning's own error comes after the config is parsed and every class built, in a wall of
    tracebacks with the install hint in the middle.
    """
    loggers = logger if isinstance(logger, list) else [logger]
    for item in loggers:
        name = str(getattr(item, "class_path", "")).rpartition(".")[2]
        if name not in LOGGER_PACKAGES:
            continue
        module, extra = LOGGER_PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError:
            how = f"pip install 'rlkl_lightning[{extra}]'" if extra else f"pip install {module}"
            raise ValueError(
                f"`trainer.logger`: {name} needs the `{module}` package, which is not "
                f"installed: {how}"
            ) from None


def _last_checkpoint(trainer: Trainer) -> str | None:
    """The file ``ckpt_path="last"`` resolves to, as Lightning resolves it, or None.

    The newest of the ``last*.ckpt`` files of the ``ModelCheckpoint`` callbacks and the files
    of ``OnExceptionCheckpoint`` callbacks.
    """
    candidates = {
        str(cb.ckpt_path) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)
    }
    for callback in trainer.checkpoint_callbacks:
        find = getattr(callback, "_find_last_checkpoints", None)
        if callable(find):
            candidates |= {str(p) for p in find(trainer)}
    existing = [p for p in candidates if os.path.isfile(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def _nothing_to_resume(trainer: Trainer, searched: list[str]) -> str:
    """The error of ``--ckpt_path last`` when no checkpoint was found: where it looked."""
    if not trainer.checkpoint_callbacks:
        where = "this run saves no checkpoints (it has no ModelCheckpoint callback)"
    else:
        places = list(searched)  # the version directories of before_instantiate_classes
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                places.append(str(callback.dirpath))
            elif isinstance(callback, ModelCheckpoint) and not searched:
                places.append(str(_default_checkpoint_dir(trainer)))
        places += [
            str(cb.ckpt_path) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)
        ]
        where = f"no last*.ckpt in {', '.join(dict.fromkeys(places))}"
    return (
        f"`--ckpt_path last`: there is no checkpoint to resume: {where}. Start a new run "
        "without `--ckpt_path`, or pass a checkpoint file as `--ckpt_path PATH`"
    )


def _default_checkpoint_dir(trainer: Trainer) -> Path:
    """Where a ``ModelCheckpoint`` without ``dirpath`` saves in this run (as Lightning picks)."""
    if not trainer.loggers:
        return Path(trainer.default_root_dir, "checkpoints")
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    save_dir = logger.save_dir or trainer.default_root_dir
    return Path(save_dir, str(logger.name), version, "checkpoints")


def main(args: list[str] | None = None) -> RLKLCLI:
    """Entry point of ``train.py``: a user's mistake ends the run with its message, last.

    An error a user can cause (the package's own ``ValueError``/``RuntimeError``, or a value
    the parser refuses) prints ``error: MESSAGE`` alone on stderr and exits with status 2;
    ``--verbose`` (anywhere in ``args``) or the environment variable ``RLKL_VERBOSE=1`` raise
    it with its traceback instead. Any other exception is a bug and keeps its traceback.
    """
    given = list(sys.argv[1:] if args is None else args)
    verbose = "--verbose" in given or os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    given = _law_classes([a for a in given if a != "--verbose"])
    if args is None:
        sys.argv[1:] = given  # LightningCLI reads the command line itself
    try:
        return _cli(None if args is None else given)
    except Exception as error:
        message = None if verbose else (timeout_message(error) or user_message(error))
        if message is None:
            raise
        message = with_option_paths(message)
        sys.stdout.flush()
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _law_classes(args: list[str]) -> list[str]:
    """``--kl.controller=adaptive`` as the law's class where its ``init_args`` follow.

    The parser takes ``--kl.controller.init_args.horizon=2000`` after a class
    (``--kl.controller=AdaptiveKLController``), not after a registered short name; there the
    command line's short name is written as its class, which is the same law. Alone, the name
    stays a name (a run's saved config says ``controller: pi``).
    """
    out = list(args)
    if not any(str(a).startswith("--kl.controller.") for a in out):
        return out
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag != "--kl.controller":
            continue
        if not eq and i + 1 < len(out):
            i, value = i + 1, out[i + 1]
        if value in LAWS:
            path = plain_spec(LAWS[value], {})["class_path"]
            out[i] = f"--kl.controller={path}" if eq else path
    return out


def _cli(args: list[str] | None) -> RLKLCLI:
    """Parse ``args``, build and run, as ``train.py`` does."""
    return RLKLCLI(
        LightningModule,
        LightningDataModule,
        parser_class=HelpfulParser,  # fit --help ends with the modules' groups
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs"},
            },
            "log_every_n_steps": 1,
        },
        save_config_kwargs={"overwrite": True},
        args=args,
    )


# How the parser reports an option it does not know, in a config file or on the command line.
_UNKNOWN_OPTION = (
    re.compile(
        r"^`(?P<outer>model)` \((?P<cls>[\w.]+)\): Option '(?P<path>[\w.]+)' is not accepted"
    ),
    re.compile(
        r"^`(?P<outer>model)` \((?P<cls>[\w.]+)\): Group '(?P<group>\w+)' does not accept option "
        r"'(?P<path>[\w.]+)'"
    ),
    re.compile(
        r"^(?:`(?P<outer>model)` \((?P<cls>[\w.]+)\): )?unrecognized arguments: --(?P<path>[\w.]+)"
    ),
    re.compile(r"^Group '(?P<group>\w+)' does not accept option '(?P<path>[\w.]+)'"),
    re.compile(r"^Subcommand '\w+' does not accept option '(?P<path>[\w.]+)'"),
)
_MOVED_GAIN = re.compile(
    r"(?:unrecognized arguments: --kl\.(?P<arg>horizon|kp|ki|k)[= ](?P<value>\S+))"
    r"|(?:Key \"kl\.(?P<key>horizon|kp|ki|k)\" is not expected)"
    r"|(?:does not accept option 'kl\.(?P<key2>horizon|kp|ki|k)')"
)
# A component's block refused by the parser: an argument its class does not take, or a value
# of the wrong type, as one of the alternatives of the option's union.
_COMPONENT = re.compile(
    r"^Parser key \"(?P<key>[\w.]+)\":\s*Does not validate against any of the Union subtypes"
    r".*?expects a function or a callable class: (?P<reason>.*?)\s*Got value: "
    r"Namespace\(class_path='(?P<cls>[\w.]+)'",
    re.DOTALL,
)
_NOT_FINITE = ("nan", "inf", "infinity")
_UNKNOWN_ARGUMENT = re.compile(r"Option '(?P<name>\w+)' is not accepted")
_WRONG_TYPE = re.compile(
    r"Parser key \"(?P<name>\w+)\":\s*Expected a <class '(?P<type>\w+)'>\. Got value: "
    r"(?P<value>.*?)\.?$",
    re.DOTALL,
)
_GROUP_FIELD = re.compile(r"^`(?P<field>[a-z_]+\.[a-z_]+)`")
_RUN_KL = "the top-level `kl` is the run's KL control (docs/options.md)"
_MODULE_KL = "the module's `penalty` is its KL penalty (docs/options.md)"


def _component_message(found: re.Match) -> str:
    """One line for a component's block the parser refused, naming the argument."""
    key, cls, reason = found["key"], found["cls"], found["reason"].strip()
    name = cls.rpartition(".")[2]
    unknown = _UNKNOWN_ARGUMENT.search(reason)
    if unknown:
        skip = 2 if key.endswith("controller") else 0  # a law: init_kl_coef, target
        try:
            takes = list(plain_spec(import_object(cls), {}, skip=skip)["init_args"])
        except (ImportError, AttributeError):
            takes = []
        listed = f": {name} takes {takes}" if takes else ""
        return f"`{key}.init_args` has no argument {unknown['name']!r}{listed}"
    wrong = _WRONG_TYPE.search(reason)
    if wrong:
        value = wrong["value"].strip()
        kind = {"float": "a number", "int": "an integer"}.get(wrong["type"], wrong["type"])
        if wrong["type"] in ("float", "int") and value.lower().lstrip("+-") in _NOT_FINITE:
            kind = f"{'a finite number' if wrong['type'] == 'float' else kind} (NaN and inf are "
            kind += "refused)"
        return f"`{key}.init_args.{wrong['name']}` ({name}) must be {kind}, got {value}"
    return f"`{key}` ({name}): {' '.join(reason.split())}"


def with_option_paths(message: str) -> str:
    """A module option's message with its YAML path; an option at an old or wrong place, its own.

    ``model.init_args.top_p`` (0.1.0) is ``model.init_args.sampling.top_p``; a group's own
    error names ``sampling.top_p``, and the command line writes ``model.init_args.`` before it.
    """
    gain = _MOVED_GAIN.search(message)
    if gain:
        name = gain["arg"] or gain["key"] or gain["key2"]
        return moved_gain(name, gain["value"] or "...")
    component = _COMPONENT.match(message)
    if component:
        return _component_message(component)
    for pattern in _UNKNOWN_OPTION:
        given = pattern.match(message)
        if given:
            found = given.groupdict()
            parts = [found.get("outer") and "model.init_args", found.get("group"), found["path"]]
            path = ".".join(p for p in parts if p)
            right = misplaced_option(path) or unknown_group_option(path, found.get("cls"))
            if right is not None:
                return right
    found = _GROUP_FIELD.match(message)
    fields_ = {f"{g}.{f.name}" for g, cls in MODULE_GROUPS.items() for f in fields(cls)}
    if found and found["field"] in fields_:
        return f"`model.init_args.{found['field']}`" + message[found.end() :]
    return message


def unknown_group_option(path: str, module: str | None = None) -> str | None:
    """One line naming a module group's option that does not exist, with the group's options.

    ``path`` is the option as given (``model.init_args.sampling.max_new_tokenz``); ``module``
    the module's class path, where the parser named it (a group another module has).
    """
    if not path.startswith(MODULE_PREFIX):
        return None
    group, _, rest = path.removeprefix(MODULE_PREFIX).partition(".")
    cls = MODULE_GROUPS.get(group)
    if cls is None or not rest:
        return None
    name = rest.partition(".")[0]
    options = [f.name for f in fields(cls)]
    if name not in options:
        close = difflib.get_close_matches(name, options, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        return (
            f"`{MODULE_PREFIX}{group}` has no option `{name}`{hint}; its options: "
            f"{', '.join(options)}"
        )
    try:
        taken = inspect.signature(import_object(module)).parameters if module else {}
    except (ImportError, AttributeError, ValueError):
        taken = {}
    if taken and group not in taken:
        groups = [g for g in MODULE_GROUPS if g in taken]
        return (
            f"`{MODULE_PREFIX}{group}`: {module.rpartition('.')[2]} has no group `{group}`; "
            f"its groups: {', '.join(groups)}"
        )
    return None


def misplaced_option(path: str) -> str | None:
    """One line naming the place of an option given where it does not live, or None.

    ``path`` is the option as given (``model.init_args.kl.placement``, ``kl.init_coef``): a
    flat option of 0.1.0, the module's ``kl`` group of 0.4.0 (now ``penalty``), a field of the
    KL penalty under the run's top-level ``kl`` or the reverse.
    """
    module = {g: {f.name for f in fields(cls)} for g, cls in MODULE_GROUPS.items()}
    penalty = module[PENALTY]
    control = {f.name for f in fields(KLSettings)}
    if path.startswith(MODULE_PREFIX):
        group, _, name = path.removeprefix(MODULE_PREFIX).partition(".")
        name = name.partition(".")[0]
        if not name and moved_option(group):
            return (
                f"`{path}` is now `{MODULE_PREFIX}{moved_option(group)}`: the modules' options "
                "come in groups since 0.2.0 (CHANGELOG.md, docs/options.md)"
            )
        if renamed_group(group) == PENALTY and (not name or name in penalty):
            new = f"{MODULE_PREFIX}{PENALTY}" + (f".{name}" if name else "")
            return f"`{path}` is now `{new}`: renamed in 0.5.0; {_RUN_KL}"
        field = name or group
        if group in ("kl", PENALTY, field) and field in control:
            return f"`{path}` is the run's KL control: `kl.{field}` (top level); {_MODULE_KL}"
        for other, names in module.items():
            if not name and group in names:
                return f"`{path}` is `{MODULE_PREFIX}{other}.{group}` (docs/options.md)"
        return None
    group, _, name = path.partition(".")
    name = name.partition(".")[0]
    if group == "kl" and name in penalty:
        return f"`{path}` is the module's KL penalty: `{MODULE_PREFIX}{PENALTY}.{name}`; {_RUN_KL}"
    return None


if __name__ == "__main__":
    main()
