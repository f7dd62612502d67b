"""LoRA/PEFT policies whose reference is the same weights with the adapters switched off.

With the module's ``peft`` option the policy gets adapters from the ``peft`` library (the
fields of a ``LoraConfig``, or of another PEFT method's config with ``peft_type``, given in
YAML); only the adapters (and the value head) train, the base weights stay frozen. Without an
explicit ``reference`` the reference is not a second model: :class:`AdaptersOff` runs the
policy's own modules with every adapter disabled, which is the base model exactly
(``tests/models/test_lora.py`` compares log-probs bit for bit). Known traps, each handled here and
tested:

* peft#3447: leaving ``disable_adapter()`` makes every active adapter trainable again (peft
  calls ``set_adapter``), frozen ones included; :meth:`AdaptersOff.off` puts every
  ``requires_grad`` flag back as it found it.
* peft#850: if the original weights of ``modules_to_save`` are lost on a reload, disabling the
  adapters no longer gives the base model. Checkpoints leave out every frozen weight
  (``original_module`` included), and a resume takes them from the model the config names.
* A reference adapter that silently failed to load (ms-swift PR #9934) leaves a freshly
  initialised one in its place, so policy and reference agree and the KL reads 0. Every
  adapter weight must come from the checkpoint: a missing or renamed one stops a resume
  (``ResumableModule.on_load_checkpoint``) and an export (:func:`load_trainable`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

if TYPE_CHECKING:
    from peft import PeftModel


def peft_config(spec: Any, option: str = "peft"):
    """A ``peft.PeftConfig`` from a config object or a dict of its fields.

    A dict without ``peft_type`` is a LoRA config; ``task_type`` defaults to ``CAUSAL_LM``.

    Raises:
        ValueError: Naming ``option`` for an unknown PEFT method or field, or for
            ``inference_mode: true`` (frozen adapters: nothing of the policy would train).
    """
    import peft

    if isinstance(spec, peft.PeftConfig):
        config = spec
    elif isinstance(spec, Mapping):
        fields = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **spec}
        kind = str(fields["peft_type"]).upper()
        if kind not in peft.PEFT_TYPE_TO_CONFIG_MAPPING:
            raise ValueError(
                f"`{option}.peft_type` must be one of {sorted(peft.PEFT_TYPE_TO_CONFIG_MAPPING)}, "
                f"got {fields['peft_type']!r}"
            )
        fields["peft_type"] = kind
        try:
            config = peft.PEFT_TYPE_TO_CONFIG_MAPPING[kind](**fields)
        except (TypeError, ValueError) as err:
            raise ValueError(f"`{option}`: not a valid {kind} config: {err}") from err
    else:
        raise ValueError(
            f"`{option}` must be a mapping of LoraConfig fields (e.g. {{r: 16, target_modules: "
            f"[q_proj, v_proj]}}) or a peft.PeftConfig, got {spec!r}"
        )
    if config.inference_mode:
        raise ValueError(
            f"`{option}.inference_mode` must be false: frozen adapters would leave nothing of "
            "the policy to train"
        )
    if config.is_prompt_learning:
        raise ValueError(
            f"`{option}`: prompt-learning methods ({config.peft_type}) are not supported; "
            "allowed: adapter methods such as LORA, LOHA, LOKR, IA3"
        )
    return config


def attach_adapters(model: nn.Module, spec: Any, option: str = "peft") -> PeftModel:
    """Add fresh adapters to ``model`` in place and freeze its base weights.

    Returns:
        The ``peft.PeftModel`` around ``model``; ``model`` itself keeps its class, with the
        adapted layers replaced by PEFT layers (so ``model`` runs with adapters on).
    """
    import peft

    try:
        wrapped = peft.get_peft_model(model, peft_config(spec, option))
    except (ValueError, TypeError, KeyError) as err:
        if str(err).startswith(f"`{option}"):
            raise
        raise ValueError(f"`{option}`: could not add adapters to the policy: {err}") from err
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"`{option}`: the adapters have no trainable weight")
    return wrapped


def has_adapters(model: nn.Module) -> bool:
    """True if ``model`` holds PEFT adapter layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


class AdaptersOff:
    """The reference of a PEFT policy: the policy's own weights with every adapter disabled.

    Holds no weights of its own (so it is not an ``nn.Module``: nothing is registered, saved
    or moved twice). It stands in for a causal LM wherever the reference is used
    (:func:`~rlkl_lightning.models.logprobs.score_tokens`,
    :func:`~rlkl_lightning.models.forward.lm_forward`):
    calling it, its ``base_model`` (the trunk) or reading its ``config`` and output embeddings
    goes to the policy, with the adapters off for the duration of the call.

    Args:
        peft_model: The ``peft.PeftModel`` returned by :func:`attach_adapters`.
    """

    def __init__(self, peft_model: PeftModel) -> None:
        self.peft_model = peft_model
        self.model = peft_model.get_base_model()

    @property
    def config(self):
        """The policy's model config."""
        return self.model.config

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Disable every adapter; on exit, restore every ``requires_grad`` flag (peft#3447)."""
        flags = [(p, p.requires_grad) for p in self.peft_model.parameters()]
        try:
            with self.peft_model.disable_adapter():
                yield
        finally:
            for param, flag in flags:
                if param.requires_grad != flag:
                    param.requires_grad_(flag)

    def __call__(self, *args, **kwargs):
        """The policy's forward with the adapters off."""
        with self.off():
            return self.model(*args, **kwargs)

    @property
    def base_model(self):
        """The policy's trunk (``model.base_model``), called with the adapters off."""
        trunk = self.model.base_model

        def forward(*args, **kwargs):
            with self.off():
                return trunk(*args, **kwargs)

        return forward

    @property
    def _fsdp_wrapped_module(self) -> nn.Module:
        """The module inside the policy's FSDP unit, once the policy is sharded.

        So the reference counts as a unit too (:func:`~rlkl_lightning.models.sharding.is_fsdp`) and
        is
        called through the unit's forward.
        """
        if not hasattr(self.model, "_fsdp_wrapped_module"):
            raise AttributeError("_fsdp_wrapped_module")
        return self.model._fsdp_wrapped_module

    def get_output_embeddings(self) -> nn.Module | None:
        """The policy's LM head (a plain one is shared: it is never adapted)."""
        return self.model.get_output_embeddings()

    def __repr__(self) -> str:
        return f"AdaptersOff({type(self.model).__name__})"


def load_trainable(model: nn.Module, state: Mapping[str, Tensor], where: str) -> None:
    """Load the trainable weights of ``model`` from ``state``; every one must be there.

    Frozen weights missing from ``state`` keep their values (checkpoints leave them out).

    Raises:
        ValueError: If a trainable weight is missing from ``state`` or a key of ``state``
            matches no weight (a renamed adapter would otherwise stay freshly initialised).
    """
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    result = model.load_state_dict(dict(state), strict=False)
    missing = sorted(trainable & set(result.missing_keys))
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(
            f"{where}: the saved weights do not fit the adapters of this policy (missing: "
            f"{missing[:5]}, unexpected: {unexpected[:5]}); a missing adapter weight would stay "
            "freshly initialised. Use the `policy` and `peft` settings it was trained with"
        )


def mix_adapters_into_base(peft_model: PeftModel, alpha: float) -> list[str]:
    """Move ``alpha`` of every LoRA update into the frozen weights; the policy stays the same.

    The reference of a PEFT policy is its base weights ``W`` (:class:`AdaptersOff`) and the
    policy is ``W + s B A``. Setting ``W <- W + alpha s B A`` and ``B <- (1 - alpha) B`` makes
    the reference ``alpha x policy + (1 - alpha) x reference`` in weight space, while the
    policy's weights stay ``W + s B A`` (to float rounding). ``alpha = 1`` merges the adapters
    and zeroes ``B``: the reference becomes the policy, and the adapters start again from
    LoRA's own initial state (``B = 0``). A module in ``modules_to_save`` (a trained copy
    beside the original, which the reference uses) mixes its original with the copy.

    Args:
        peft_model: The ``peft.PeftModel`` of :func:`attach_adapters`.
        alpha: The share of the policy in the new reference, in ``(0, 1]``.

    Returns:
        The names (in the base model) of the frozen weights that changed.

    Raises:
        ValueError: For adapters other than plain LoRA on linear layers (DoRA, a LoRA bias,
            other PEFT methods): their update is not ``s B A``.
    """
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    model = peft_model.get_base_model()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    adapted = [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    if not layers or len(layers) != len(adapted):
        raise ValueError(
            "ReferenceRefresh: with `peft` the reference can be refreshed for LoRA adapters "
            "only (peft_type LORA); this policy has other adapters"
        )
    changed = []
    with torch.no_grad():
        for name, layer in layers:
            for adapter in layer.active_adapters:
                if adapter not in layer.lora_A:
                    raise ValueError(
                        f"ReferenceRefresh: the LoRA layer {name!r} is not a linear layer; "
                        "allowed: LoRA on linear layers (no embedding or convolution adapters)"
                    )
                if layer.use_dora.get(adapter) or layer.lora_bias.get(adapter):
                    raise ValueError(
                        "ReferenceRefresh: `peft.use_dora` and `peft.lora_bias` must be false "
                        "to refresh the reference (their update is not s B A)"
                    )
                base = layer.get_base_layer().weight
                delta = layer.get_delta_weight(adapter)
                base.add_(delta.to(base.dtype), alpha=alpha)
                b = layer.lora_B[adapter].weight
                b.zero_() if alpha == 1 else b.mul_(1 - alpha)
            changed.append(f"{name}.base_layer.weight")
        for name, wrapper in model.named_modules():
            if not isinstance(wrapper, ModulesToSaveWrapper):
                continue
            for adapter in wrapper.active_adapters:
                copy = dict(wrapper.modules_to_save[adapter].named_parameters())
                for pname, param in wrapper.original_module.named_parameters():
                    source = copy[pname].detach().to(param.dtype)
                    param.copy_(source) if alpha == 1 else param.lerp_(source, alpha)
                    changed.append(f"{name}.original_module.{pname}")
    return changed
