"""lm-evaluation-harness on AQUA models: the ``aqua`` model of lm_eval, and ``aqua-export lm-eval``.

``AquaLM`` is lm_eval's own ``hf`` model (HFLM) with the forward swapped, so tokenisation, batching,
truncation, rolling windows and stop handling are lm_eval's, item for item:

    model=M [projection=P, k_ratio=..., slice_ratio=..., h2o_ratio=..., selection=..., slice_alloc=..., k_alloc=...,
             token_ratio=..., token_budget=..., token_sink=..., token_window=...]
        the PyTorch reference: M loaded as `aqua-export eval` loads it, AQUA applied (attention.apply_aqua)
        for the life of the object (close() restores the model). Token selection acts as in a built folder: a
        forward of several tokens (a loglikelihood item, a prompt) attends exactly, each generated token selects
    folder=DIR [threads=N, kernel=auto|native|function]
        a built folder run by ONNX Runtime (runtime.OrtLM): logits of a batch from an empty cache,
        greedy generation from the folder's own cache

The local tasks (lm_eval_tasks/, group ``aqua_local``) need no network; real tasks (``--tasks hellaswag``)
need their datasets in the Hugging Face cache, as for lm_eval itself.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from . import models, settings
from .config import AquaConfig, ConfigError
from .projection import load_projection
from .reference.attention import apply_aqua
from .runtime.folder import FolderConfig
from .runtime.lm import OrtLM
from .runtime.sampling import SamplingConfig

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
LOCAL_TASKS = ("aqua_lastword", "aqua_choice", "aqua_rolling", "aqua_copy")


class _OrtModel(torch.nn.Module):
    """What HFLM reads of a model, served by a built folder: config, device, __call__ -> .logits, generate."""

    def __init__(self, lm, tokenizer, folder: str):
        from transformers import AutoConfig

        super().__init__()
        self.lm, self.tokenizer = lm, tokenizer
        self.config = AutoConfig.from_pretrained(folder)  # the source model's, copied by the build: same max_length

    @property
    def device(self):
        return torch.device("cpu")

    def tie_weights(self):
        pass

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """input_ids [B, T] (lm_eval pads on the right: every scored position sees only real tokens)."""
        ids = input_ids.cpu().numpy()
        mask = np.ones_like(ids) if attention_mask is None else attention_mask.cpu().numpy()
        logits, _ = self.lm.step(ids, mask, self.lm.empty_past(ids.shape[0]))
        return type("Out", (), {"logits": torch.from_numpy(np.asarray(logits, np.float32))})()

    def generate(self, input_ids, attention_mask, max_length: int, stopping_criteria, **_):
        """Greedy, as HF's generate with do_sample=False, in the runtime's own loop: stops when every row meets a
        stop criterion (or EOS) or at max_length. Returns [B, T + new] with the context."""
        ids = input_ids.cpu().numpy()

        def whole(new):
            return torch.as_tensor(np.concatenate([ids, new], 1))

        new = self.lm.generate(ids, attention_mask.cpu().numpy(), SamplingConfig(max_new_tokens=max_length - ids.shape[1]),
                               self.tokenizer.eos_token_id, stop=lambda n: bool(stopping_criteria(whole(n), None).all()))
        return whole(new)


def _hf_tokenizer(folder: str):
    """The folder's tokenizer as transformers loads it: lm_eval's HFLM takes nothing else (serving uses
    runtime.tokenizer, which needs no transformers)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def config_of_model_args(**values) -> AquaConfig:
    """lm_eval passes model_args as strings: each setting's module converts its own, AquaConfig validates them."""
    return AquaConfig(**settings.from_text(values))


@register_model("aqua")
class AquaLM(HFLM):
    SETTINGS = tuple(settings.SETTINGS)  # the model_args that choose AQUA's settings (settings.MECHANISMS)

    def __init__(self, model: str | None = None, folder: str | None = None, projection: str | None = None,
                 threads: int = 0, kernel: str = "auto", batch_size: int | str = 1, max_length: int | None = None,
                 **kwargs):
        given = {k: kwargs.pop(k) for k in self.SETTINGS if k in kwargs}
        if (model is None) == (folder is None):
            raise ConfigError("give the aqua model either model=M (the PyTorch reference) or folder=DIR (a built folder)")
        self._stack = contextlib.ExitStack()
        self._session = None
        if folder is not None:

            if projection is not None or given:
                raise ConfigError("a folder carries its own AQUA settings: drop projection / "
                                  f"{' / '.join(self.SETTINGS)} with folder=")
            context = FolderConfig.from_folder(folder).serving_context  # a missing folder: one line
            tok = _hf_tokenizer(folder)
            serving = (int(batch_size) if str(batch_size).isdigit() else 1, int(max_length or context))
            net = _OrtModel(OrtLM.from_folder(folder, int(threads), kernel, serving=serving, all_logits=True), tok, folder)
            self.aqua_config = net.lm.cfg.aqua
        else:
            config = config_of_model_args(**given)
            config.require_projection(projection is not None, "projection=FILE", spell="arg")
            net, tok = models.load(model)
            if projection is not None:
                self._session = self._stack.enter_context(apply_aqua(net, load_projection(projection), config))
            self.aqua_config = config
        super().__init__(pretrained=net, tokenizer=tok, backend="causal", batch_size=batch_size,
                         max_length=None if max_length is None else int(max_length), **kwargs)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self._session is not None:  # AQUA's own cache: H2O eviction and the narrow AQUA-Memory cache
            generation_kwargs[models.cache_keyword(self._session.model)] = self._session.new_cache()
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def close(self) -> None:
        """Restore the model (the reference's attention patches live until here)."""
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def evaluate(lm: AquaLM, tasks: list[str], include_path: str | None = None, limit: float | None = None,
             log_samples: bool = False) -> dict:
    """lm_eval.simple_evaluate on ``lm`` with the local tasks (and include_path's) registered. Returns its results
    dict (``samples`` per task when log_samples)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + ([include_path] if include_path else [])
    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}: use aqua_local, one of {', '.join(LOCAL_TASKS)}, "
                          "an lm_eval task, or a YAML under --include-path")
    if limit is not None and not limit > 0:
        raise ConfigError(f"--limit {limit:g} is not a number of items: give a count >= 1, or a share in (0, 1)")
    try:
        return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=log_samples,
                               bootstrap_iters=0)
    except ConnectionError as e:  # datasets' own "Couldn't reach ... on the Hub", offline or not
        raise ConfigError(f"lm-eval task(s) {', '.join(tasks)} need their datasets from the Hugging Face hub, which "
                          f"this machine cannot reach ({str(e).splitlines()[0][:120]}): on a connected machine, load "
                          "them once into the Hugging Face cache (HF_HOME) and copy it here; or use --tasks aqua_local, "
                          "which needs no network") from None
