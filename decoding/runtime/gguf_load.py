"""A GGUF file loaded as it is: config, tokenizer and model built straight from the file.

`transformers` loads a GGUF file by parsing all of its metadata with gguf-py's reader (7 s for a
150k-token vocabulary; twice, once for the config and once for the tensors), dequantizing every
tensor into a float32 state dict and loading that into the model; the project then wrote that model
out as a float32 checkpoint (6 GB for a 1.5B model) to load it again. Here the model is built on the
meta device from the file's config, and each tensor is read with one positioned read, dequantized by
the same gguf-py function, processed by the same `transformers` TensorProcessor (llama's q/k row
order) and written into its parameter, a slice of rows at a time where the processor leaves rows as
they are (so temporaries stay small); the result is bitwise the model `from_pretrained(dir,
gguf_file=...)` builds. Tensors of the types a caller replaces right after by its own quantized
layers (quant.quantize_from_gguf) can be left unread: a 4-bit file then costs little more than its
other tensors.

The config comes from `transformers`' own key tables over its fast metadata reader (milliseconds)
for the architectures whose legacy loader is nothing but those tables (llama, qwen2), and from
`transformers` itself for the others. The tokenizer is converted from the file once (seconds for a
150k vocabulary) into a small folder of tokenizer files in the cache, and read from there after.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from decoding.base.errors import BackendError
from decoding.runtime.gguf_tensors import FileTensor, file_tensors
from decoding.runtime.packaged import nearest_existing
from decoding.runtime.quant import kernel_fits

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

# Architectures whose config transformers' legacy GGUF loader builds from its key tables alone (no
# branch of its own in load_gguf_checkpoint), so the tables applied to the fast reader's metadata
# give the same config; every other architecture goes through transformers' own (slow) reader.
TABLE_ONLY = ("llama", "qwen2")
CHUNK_ELEMENTS = 1 << 22  # rows dequantized at once: bounds the float32 temporaries to tens of MB
KEY_BYTES = 1 << 20  # how much of the file's start (its header: the vocabulary) keys its tokenizer folder


@dataclass(frozen=True)
class Plan:
    """What load_model does with the file: each tensor's parameter, and the ones it leaves unread."""

    names: dict[str, str]  # GGUF tensor name -> the model's parameter name
    skipped: frozenset[str]  # parameter names left uninitialised for the caller to replace


def read_config(gguf: Path) -> PretrainedConfig:
    """The model's config from the file's metadata, as `from_pretrained(..., gguf_file=...)` builds it."""
    return _config(gguf, _config_dict(gguf, *_metadata(gguf)))


def _config(gguf: Path, values: dict[str, Any]) -> PretrainedConfig:
    from transformers import CONFIG_MAPPING

    model_type = values.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise BackendError(f"{gguf}: transformers has no config for GGUF model type {model_type!r}")
    try:
        # (a key of the mapping: a str)
        return CONFIG_MAPPING[cast(str, model_type)].from_dict(values, name_or_path=str(gguf))
    except (ValueError, KeyError, TypeError) as e:
        raise BackendError(f"{gguf}: its metadata does not make a {model_type} config ({_first_line(e)})") from None


def load_tokenizer(gguf: Path, cache: Path) -> Any:
    """The file's tokenizer, converted from it once into a folder of `cache` and read from there after."""
    folder = cache / tokenizer_folder_name(gguf)
    if folder.is_dir():
        try:
            return _tokenizer_from(folder)
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            log.warning("the tokenizer in %s does not load (%s); converting %s again", folder, e, gguf.name)
    _convert_tokenizer(gguf, folder)
    return _tokenizer_from(folder)


def _tokenizer_from(folder: Path) -> Any:
    """The tokenizer saved in `folder`, with the backend the GGUF conversion built (tokenizer.json) as
    it is: transformers' generic class, because a model's own class (Qwen2Tokenizer) given the folder
    rebuilds its pipeline from its own defaults and drops the file's (another pre-tokenizer regex, a
    normalizer the file does not have), and given the backend as well, builds its own first (2 s)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder)


def tokenizer_folder_name(gguf: Path) -> str:
    """The cache folder of a file's tokenizer: its stem, size and a hash of its start (where the
    vocabulary is), so that another file, or the same name written again, gets another folder."""
    size = gguf.stat().st_size
    with gguf.open("rb") as f:
        digest = hashlib.sha256(f.read(KEY_BYTES)).hexdigest()[:16]
    return f"{gguf.stem}-{size}-{digest}.tokenizer"


def load_model(gguf: Path, dtype: torch.dtype, skip_types: frozenset[str] = frozenset()) -> torch.nn.Module:
    """The causal LM of a GGUF file in `dtype`, bitwise the one `from_pretrained(gguf.parent,
    gguf_file=gguf.name, dtype=dtype)` builds (but without its quantization_config).

    A tensor whose GGUF type is in `skip_types` is not read where it is the weight of a linear layer
    the int4 kernel takes (quant.kernel_fits: the layers quant.quantize_from_gguf replaces) other
    than the LM head: that weight is an uninitialised tensor of its shape and dtype, which costs no
    memory until something writes it. The embedding and the LM head are always read.
    """
    t0 = time.perf_counter()
    metadata, tensor_names = _metadata(gguf)
    architecture = metadata["general.architecture"]
    values = _config_dict(gguf, metadata, tensor_names)
    config = _config(gguf, values)
    _check_legacy(gguf, architecture)
    model = _empty_model(gguf, config, dtype)
    tensors = file_tensors(gguf)
    processor = _processor(architecture, values)
    plan = _plan(model, tensors, processor, skip_types)
    _check_complete(gguf, model, plan)
    missing = _fill(model, gguf, tensors, processor, plan)
    _finish(model, missing)
    log.info(
        "built %s from %s in %.1fs (%d tensors read, %d left to the caller)",
        type(model).__name__,
        gguf.name,
        time.perf_counter() - t0,
        len(plan.names) - len(plan.skipped),
        len(plan.skipped),
    )
    return model


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def _metadata(gguf: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The file's metadata (string arrays as their lengths) and tensor names: transformers' fast reader."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        return read_gguf_metadata(str(gguf))
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise BackendError(f"{gguf}: not a GGUF file transformers reads ({_first_line(e)})") from None


def _config_dict(gguf: Path, metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """The config dict transformers builds from the file (its legacy loader's "config" part, or its
    new per-architecture functions), before it becomes a config class."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config

    architecture = metadata["general.architecture"]
    if architecture in GGUF_CONFIG_ARCHS:
        return get_gguf_config(metadata, tensor_names)
    # transformers renames a llama file named exactly "mistral" (its check is a list membership)
    if architecture in TABLE_ONLY and metadata.get("general.name") != "mistral":
        return _table_config(metadata, tensor_names)
    return _legacy_config(gguf, architecture)


def _table_config(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """load_gguf_checkpoint's config for an architecture it has no branch for: its key table over
    the metadata, its defaults, tie_word_embeddings from the tensors and the vocabulary's size."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    architecture = metadata["general.architecture"]
    # its "config" part: per metadata prefix, a key's config name (-1: none)
    table = cast(dict[str, dict[str, Any]], GGUF_TO_TRANSFORMERS_MAPPING["config"])
    values: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}).items():
        values.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        target = table.get(prefix, {}).get(rest)
        if target is not None and target != -1:
            # gguf-py's reader gives a one-element array as its element, as it does a scalar
            values[target] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in metadata:
        values["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the fast reader gives its length
    return values


def _legacy_config(gguf: Path, architecture: str) -> dict[str, Any]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config: dict[str, Any] = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
        return config
    except (ValueError, KeyError) as e:
        raise BackendError(
            f"{gguf}: transformers does not load GGUF architecture {architecture!r} ({_first_line(e)})"
        ) from None


def _check_legacy(gguf: Path, architecture: str) -> None:
    """Architectures on transformers' new GGUF path have conversions of their own this loader does not apply."""
    from transformers.integrations.gguf import is_gguf_arch_supported

    if is_gguf_arch_supported(architecture):
        raise BackendError(
            f"{gguf}: GGUF architecture {architecture!r} is not built by this loader (transformers converts "
            "its tensors with its own weight conversions); use a llama or qwen2 file"
        )


def _empty_model(gguf: Path, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The model on the meta device, constructed as from_pretrained constructs it: no memory, no init."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils.generic import ContextManagers

    try:
        # (the mapping's stub types a value as a pair of classes; it is the one causal LM class)
        cls = cast("type[PreTrainedModel]", MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    except KeyError:
        raise BackendError(f"{gguf}: model type {config.model_type!r} is not a causal LM transformers builds") from None
    config.dtype = dtype  # as from_pretrained records it
    try:
        with ContextManagers(cls.get_init_context(dtype, False, False, None)):
            model = cls(config)
            patch_output_recorders(model)
    except (AssertionError, ValueError, TypeError, IndexError, KeyError, AttributeError, RuntimeError) as e:
        # transformers reads the config but cannot build the model it describes (say a padding token
        # outside the vocabulary): the file's metadata, not the caller, is at fault.
        raise BackendError(
            f"{gguf}: transformers cannot build a {config.model_type} model from its metadata "
            f"({type(e).__name__}: {_first_line(e)}); the file is not one the project can run: convert it again "
            "(llama.cpp's convert_hf_to_gguf.py) or give another model"
        ) from None
    return model


def _processor(architecture: str, values: dict[str, Any]) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    # (typed as the base class: a call through the dict's joined value type is not seen as transformers')
    processor_class: type[TensorProcessor] = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    return processor_class(config=values)


class _TopLevel:
    """What get_gguf_hf_weights_map reads of a model, without the submodules it would walk too
    (each walk builds gguf-py's name table again: seconds); the top level's names are the state dict's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def named_children(self) -> list[tuple[str, torch.nn.Module]]:
        return []


def _plan(model: PreTrainedModel, tensors: list[FileTensor], processor: Any, skip_types: frozenset[str]) -> Plan:
    from gguf import GGMLQuantizationType
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    unknown = sorted(skip_types - set(GGMLQuantizationType.__members__))
    if unknown:
        raise ValueError(f"skip_types names no GGUF type: {', '.join(unknown)}")
    mapped = get_gguf_hf_weights_map(_TopLevel(model), processor)
    state = set(model.state_dict())
    names = {t.name: mapped[t.name] for t in tensors if mapped.get(t.name) in state}
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    skipped = {
        names[t.name]
        for t in tensors
        if t.type_name in skip_types and t.name in names and _replaceable(names[t.name], modules, head)
    }
    return Plan(names, frozenset(skipped))


def _replaceable(name: str, modules: dict[str, torch.nn.Module], head: torch.nn.Module | None) -> bool:
    """Whether the parameter is the weight of a layer quant.quantize_from_gguf may replace: a linear
    layer the int4 kernel takes. Not the LM head, which the int8 path keeps (quant.q8_head_from_gguf)."""
    module_name, _, leaf = name.rpartition(".")
    module = modules.get(module_name)
    return leaf == "weight" and module is not head and kernel_fits(module)


def _check_complete(gguf: Path, model: PreTrainedModel, plan: Plan) -> None:
    """Every parameter comes from the file or is tied to one that does (transformers would initialise
    the others at random, with a warning)."""
    tied = set(model.all_tied_weights_keys)
    missing = sorted(set(model.state_dict()) - set(plan.names.values()) - tied)
    if missing:
        raise BackendError(f"{gguf}: the file has no tensor for {', '.join(missing[:3])} ({len(missing)} in all)")


@torch.no_grad()
def _fill(model: PreTrainedModel, gguf: Path, tensors: list[FileTensor], processor: Any, plan: Plan) -> set[str]:
    """Give every parameter the file has its real tensor (the skipped ones an unwritten one); the
    state dict names the file does not have (tied weights), for tie_weights."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    targets = {name: _materialize(model, name) for name in plan.names.values()}
    read = [t for t in tensors if t.name in plan.names and plan.names[t.name] not in plan.skipped]
    if type(processor) is TensorProcessor:
        # The base processor returns every tensor as it is, so its rows can be dequantized a slice at a
        # time (small temporaries), the slices spread over torch's threads (numpy releases the GIL).
        slices = [(t, targets[plan.names[t.name]], first, n) for t in read for first, n in _row_slices(t)]
        with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
            list(pool.map(lambda job: _copy_rows(gguf, *job), slices))
        return set(model.state_dict()) - set(targets)
    extra: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}  # MoE processors write stacked experts here
    for t in read:  # one at a time: a processor may keep state across tensors (MoE experts)
        _copy_processed(gguf, t, processor, plan.names, extra, targets)
    for name, value in extra["tensors"].items():
        if name not in targets:
            raise BackendError(f"{gguf}: the file's tensors make a {name} the model does not have")
        _copy_checked(targets[name], value, name)
    return set(model.state_dict()) - set(targets)


def _materialize(model: PreTrainedModel, name: str) -> torch.Tensor:
    """Replace the meta parameter `name` by an uninitialised CPU one (untouched pages cost no memory)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, leaf)
    new = torch.nn.Parameter(torch.empty(old.shape, dtype=old.dtype), requires_grad=old.requires_grad)
    # transformers' init functions leave a flagged tensor alone
    new._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' flag: torch's stub lacks it
    setattr(module, leaf, new)
    return new.data  # no autograd: written from pool threads, which do not share the caller's no_grad


def _read(gguf: Path, t: FileTensor, first_row: int, rows: int) -> np.ndarray:
    """Rows [first_row, first_row + rows) of a tensor dequantized to float32 by gguf-py, as transformers does."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    row_bytes = t.nbytes // t.rows
    raw = np.empty((rows, row_bytes), dtype=np.uint8)
    with gguf.open("rb", buffering=0) as f:  # a file of its own: slices are read on several threads
        f.seek(t.start + first_row * row_bytes)
        if f.readinto(raw.data.cast("B")) != raw.nbytes:
            raise BackendError(f"{gguf}: tensor {t.name} runs past the end of the file; download or copy it again")
    try:
        return dequantize(raw, GGMLQuantizationType[t.type_name])
    except NotImplementedError:
        raise BackendError(f"{gguf}: tensor {t.name} is {t.type_name}, which gguf-py cannot dequantize") from None


def _row_slices(t: FileTensor) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // t.shape[-1])
    for first in range(0, t.rows, step):
        yield first, min(step, t.rows - first)


def _copy_rows(gguf: Path, t: FileTensor, target: torch.Tensor, first: int, n: int) -> None:
    if target.numel() != t.rows * t.shape[-1]:
        raise BackendError(f"{gguf}: tensor {t.name} has shape {t.shape}, the model wants {tuple(target.shape)}")
    target.view(t.rows, t.shape[-1])[first : first + n].copy_(torch.from_numpy(_read(gguf, t, first, n)))


def _copy_processed(
    gguf: Path,
    t: FileTensor,
    processor: Any,
    names: dict[str, str],
    extra: dict[str, dict[str, torch.Tensor]],
    targets: dict[str, torch.Tensor],
) -> None:
    """A whole tensor through the architecture's TensorProcessor (which may reorder its rows)."""
    weights = _read(gguf, t, 0, t.rows).reshape(t.shape)
    result = processor.process(weights=weights, name=t.name, tensor_key_mapping=names, parsed_parameters=extra)
    if result.name in names:
        name = names[result.name]
        _copy_checked(targets[name], torch.from_numpy(np.ascontiguousarray(result.weights)), name)


def _copy_checked(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise BackendError(f"the file's tensor for {name} has shape {tuple(value.shape)}, not {tuple(target.shape)}")
    target.copy_(value)


def _finish(model: PreTrainedModel, missing: set[str]) -> None:
    """What from_pretrained does after its weights are in: buffers computed, weights tied, eval mode."""
    for name in model.all_tied_weights_keys:
        if name in missing:
            model.get_parameter(name)._is_hf_initialized = True  # type: ignore[attr-defined]  # (as in _materialize)
    for name, buffer in model.named_non_persistent_buffers():
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name).register_buffer(leaf, torch.empty_like(buffer, device="cpu"), persistent=False)
    # transformers' init pass: every parameter is flagged, so it computes the buffers (rotary inv_freq) only
    model.initialize_weights()
    model.tie_weights(missing_keys=missing, recompute_mapping=False)
    model.eval()


def _convert_tokenizer(gguf: Path, folder: Path) -> None:
    """Convert the file's tokenizer into a temporary folder beside `folder` and rename it into place:
    of two processes converting at once, the one whose rename comes second uses the first's folder."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}-{secrets.token_hex(4)}")  # mkdir: the umask's mode
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            with _plain_gguf_reader():
                converted = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # IndexError: a special token's id outside the vocabulary.
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            read_config(gguf)  # an architecture transformers lacks is named as such
            raise BackendError(
                f"{gguf}: transformers cannot read its tokenizer ({type(e).__name__}: {_first_line(e)}); the file's "
                "tokenizer metadata is broken: convert it again or give another model"
            ) from None
        converted.save_pretrained(tmp)
        _rename_into_place(tmp, folder)
    except OSError as e:
        above = nearest_existing(folder)
        reason = e.strerror or str(e) if above.is_dir() else f"{above} is a file, not a folder"
        raise BackendError(
            f"writing {gguf.name}'s tokenizer into {folder} failed ({reason}); free space there or "
            "set model.cache_dir (or TOT_CACHE_DIR) to a writable folder"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s's tokenizer into %s in %.1fs (once)", gguf.name, folder, time.perf_counter() - t0)


@contextlib.contextmanager
def _plain_gguf_reader() -> Iterator[None]:
    """transformers converts a GGUF tokenizer through gguf-py's reader, which slices its memmap once
    per metadata element (750k slices for a 150k-token vocabulary, a memmap's slicing microseconds
    each); over a plain array of the same mapping it parses the same fields 3x faster (16 -> 5.6 s)."""
    import gguf

    class PlainReader(gguf.GGUFReader):
        @property  # type: ignore[override]  # gguf declares `data` a plain attribute; its setter stays
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

    plain = gguf.GGUFReader
    # transformers imports it from the package at each call; a class patched for the duration
    gguf.GGUFReader = PlainReader  # type: ignore[misc]  # (mypy takes a class for a constant)
    try:
        yield
    finally:
        gguf.GGUFReader = plain  # type: ignore[misc]


def _rename_into_place(tmp: Path, folder: Path) -> None:
    """Rename `tmp` to `folder`; a `folder` already there (another process's, or one that did not
    load) is kept if it loads, else replaced."""
    try:
        os.rename(tmp, folder)
        return
    except OSError:
        if not folder.is_dir():
            raise
    if _loads(folder):
        return  # the winner's copy; ours is removed by the caller
    old = folder.with_name(f"{folder.name}.old{os.getpid()}")
    os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _loads(folder: Path) -> bool:
    try:
        _tokenizer_from(folder)
    except Exception:  # tokenizers raises a bare Exception for a bad file
        return False
    return True
