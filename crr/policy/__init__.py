"""The policy: the embedded tiny default model (crr.policy.model), grammar-constrained tool-call generation
(crr.policy.backend, crr.policy.grammar); its SFT warm start is crr.sft.

Nothing is imported here, so that `crr.policy.model` loads with torch, transformers and TRL alone (the SFT
step, crr.sft.trainer, can then run by itself on a GPU node)."""

# The generation backends (crr.policy.backend: TransformersBackend, VLLMBackend, VLLMServerBackend) by the
# names that `crr train`'s `backend=` and `crr eval --backend` take; here, not in crr.policy.backend, so that
# the configs that check a name need not import torch.
BACKENDS = ("transformers", "vllm", "vllm-server")
SERVER_BACKEND = "vllm-server"   # the one that takes a server URL (TRL's vllm_mode="server")
# The dtypes a policy's weights load in (crr train's `dtype`, crr eval's --dtype; load_policy): auto = as saved;
# float32 on CPUs without AVX512-BF16, where bf16 arithmetic is emulated (docs/warm-start.md).
DTYPES = ("auto", "float32", "bfloat16")


def check_backend(backend: str, vllm_server: str | None, options: bool = False) -> None:
    """A CRRError unless `backend` is one of BACKENDS and a server URL (http or https) is given exactly when it
    is vllm-server. The message names the settings as config keys (backend=, vllm_server=) or, with `options`,
    as crr eval's options (--backend, --vllm-server)."""
    import re

    from crr.errors import CRRError

    def name(key: str, value: str) -> str:
        return f"--{key.replace('_', '-')} {value}" if options else f"{key}={value}"

    if backend not in BACKENDS:
        raise CRRError(f"unknown generation backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == SERVER_BACKEND and not vllm_server:
        raise CRRError(f"{name('backend', SERVER_BACKEND)} needs {name('vllm_server', 'URL')}, the address of a "
                       "running vLLM server (e.g. http://127.0.0.1:8000; README: Going past one machine)")
    if vllm_server and backend != SERVER_BACKEND:
        raise CRRError(f"{name('vllm_server', vllm_server)} is for {name('backend', SERVER_BACKEND)} only (the "
                       f"backend is {backend}): add {name('backend', SERVER_BACKEND)}, or drop the server URL")
    if vllm_server and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", vllm_server):
        raise CRRError(f"{name('vllm_server', repr(vllm_server))} is not an http(s) URL (e.g. http://127.0.0.1:8000)")


def check_model(name: str, label: str, *, adapter: bool) -> None:
    """Before any work, that a model named by a local path is one: a directory holding config.json or, where
    `adapter` (the commands that only generate: eval, the credit audit, which merge it into its base), a LoRA
    adapter (adapter_config.json); training needs a whole model. A name that is no local path is a hub id, left
    to the loader. `label` names the setting in the message (`model=PATH`, `--model PATH`)."""
    from pathlib import Path

    from crr.errors import CRRError

    path = Path(name).expanduser()
    if not (name.startswith(("/", ".", "~")) or path.exists()):
        return
    kinds = f"a model directory{', a LoRA adapter directory' if adapter else ''} or a hub id"
    if not path.exists():
        raise CRRError(f"{label}: no such directory; pass {kinds}")
    if not path.is_dir():
        raise CRRError(f"{label} is a file; pass {kinds}")
    if (path / "config.json").is_file() or adapter and (path / "adapter_config.json").is_file():
        return
    if (path / "adapter_config.json").is_file():
        raise CRRError(f"{label} is a LoRA adapter, and this command takes a whole model: pass the adapter's base "
                       "model, or the adapter merged into it (crr eval and crr credit audit take an adapter)")
    made = "`crr model init`, `crr sft` or `crr train`" if adapter else "`crr model init` or `crr sft`"
    raise CRRError(f"{label}: that directory holds no model (config.json){' or adapter' if adapter else ''}; pass a "
                   f"directory made by {made}, or a hub id")
