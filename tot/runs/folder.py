"""What a run folder promises (docs/tools.md, "What a run folder promises"): one configuration.

The settings that change how a problem is computed are recorded at the folder's first run, as the
values that ran (the device, weight format, attention, linear kernel and activations `auto` chose), in
configuration.json, written once; each record carries the configuration's fingerprint. A rerun under
other settings is refused in one line naming each difference. Which problems run (data.limit,
data.offset, the shards) is a selection, not a configuration, and the keys in SPEED_ONLY change
only how fast a run goes. Every other key of the config counts (tests/test_folder.py checks it).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from decoding import BackendError, ConfigError
from tasks import TASKS, make_task
from tot.runs.output import write_atomic
from tot.runs.results import ResultsError, ResultStore

RECORD = "configuration.json"
LEGACY = Path(".hydra") / "config.yaml"  # what Hydra wrote for the latest run, before configuration.json
SELECTION = ("data.limit", "data.offset", "data.shard", "data.num_shards")  # which problems, not how
ANOTHER_FOLDER = "give this run its own folder with hydra.run.dir=... (in a sweep: hydra.sweep.dir=...)"
MAX_NAMED = 8  # differences named in the one line; the rest are counted

Settings = dict[str, Any]


def _on_cpu(s: Mapping[str, Any]) -> bool:
    return s.get("model.device") == "cpu" and s.get("decoder.name") != "server"


def _greedy(s: Mapping[str, Any]) -> bool:
    return s.get("gen.temperature") == 0 and s.get("gen.eval_temperature") == 0


def _always(s: Mapping[str, Any]) -> bool:
    return True


# The keys that do not change what a problem computes, each with the settings under which that holds.
# Every other key of the config is configuration.
SPEED_ONLY: tuple[tuple[str, Callable[[Mapping[str, Any]], bool]], ...] = (
    # The CPU forward is batch-invariant: a token's logits do not depend on what shares the forward.
    # On a GPU in bfloat16 they do, so there the number of problems in flight counts.
    ("run.concurrency", _on_cpu),
    # The KV memory bounds how many sequences decode at once (the rest wait): the same, for the same reason.
    ("model.kv_memory", _on_cpu),
    ("model.kv_memory_mb", _on_cpu),
    # Graphs replay the same forward; the buckets pad it: on a CPU (eager) the same bits.
    ("model.cuda_graphs", _on_cpu),
    ("model.graph_rows", _on_cpu),
    ("model.graph_tokens", _on_cpu),
    ("model.graph_context", _on_cpu),
    # At temperature 0 nothing is sampled: every rule gives the argmax.
    ("verify.rule", _greedy),
    # Where a GGUF's conversion is kept: the same weights, only the first load's time differs.
    ("model.cache_dir", _always),
    ("draft.cache_dir", _always),
    # How long to wait for a server and where its key is: a request past the timeout ends the run
    # (the rerun resumes), it never changes an answer.
    ("server.timeout", _always),
    ("server.api_key_env", _always),
)


@dataclass(frozen=True)
class Configuration:
    settings: Settings  # dotted config key -> the value that ran
    fingerprint: str
    source: str = "this run"  # where a folder's record was read from

    @classmethod
    def of(cls, container: Mapping[str, Any]) -> Configuration:
        """The configuration of a resolved config (OmegaConf.to_container(cfg, resolve=True))."""
        return cls.from_settings(settings_of(container, resolved(container)))

    @classmethod
    def from_settings(cls, settings: Settings, source: str = "this run") -> Configuration:
        plain = json.loads(json.dumps(settings, default=str))  # as it reads back from configuration.json
        text = json.dumps(canonical(plain), sort_keys=True)
        return cls(plain, hashlib.sha256(text.encode()).hexdigest()[:16], source)


def canonical(value: Any) -> Any:
    """`value` with whole floats as integers: gen.temperature=0 and =0.0 are one setting (the rerun
    check compares with ==, which agrees), so they get one fingerprint."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Settings:
    out: Settings = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def settings_of(container: Mapping[str, Any], resolved_values: Mapping[str, Any]) -> Settings:
    """Every key of the config but Hydra's own, the selection and the speed-only keys (where they
    are), with the values `auto` resolved to."""
    flat = flatten({k: v for k, v in container.items() if k != "hydra"})
    flat.update(resolved_values)
    counted = {k: v for k, v in flat.items() if k not in SELECTION and not _no_draft_model(k, flat)}
    return {k: v for k, v in counted.items() if not any(k == key and when(counted) for key, when in SPEED_ONLY)}


def _no_draft_model(key: str, flat: Mapping[str, Any]) -> bool:
    """A draft model's options where none is configured (draft.path unset): nothing reads them."""
    return key.startswith("draft.") and key != "draft.path" and not flat.get("draft.path")


def resolved(container: Mapping[str, Any]) -> Settings:
    """What `auto` means for the target (and the draft model) here: the device, weight format,
    attention, linear kernel and activations load_model will use (a server's decoding is its own:
    nothing to resolve); and the depth a task takes where `task.depth` leaves it to the task."""
    # Here, not at the top: resolving needs the model runtime (torch), and a command that only reads a
    # folder (tot.show, tot.collect) imports this module.
    from decoding import (
        ModelSpec,
        activations_and_why,
        is_gguf,
        resolve_attention,
        resolve_device,
        resolve_linear,
        resolve_weights,
    )
    from tot.runs.config import TASK_RUN_KEYS

    out: Settings = {}
    task = container.get("task") or {}
    if task.get("depth") is None and task.get("name") in TASKS:
        options = {k: v for k, v in task.items() if k not in TASK_RUN_KEYS}
        out["task.depth"] = make_task(task["name"], None, options).depth
    if (container.get("decoder") or {}).get("name") == "server":
        return out
    for key in ("model", "draft"):
        values = {k: v for k, v in (container.get(key) or {}).items() if v is not None}
        if key == "draft" and not values.get("path"):
            continue
        spec = ModelSpec.from_config(values, key)
        device = resolve_device(spec.device, key)
        gguf = Path(spec.path) if is_gguf(spec.path) else None
        out[f"{key}.device"] = str(device)
        out[f"{key}.weights"] = weights = resolve_weights(spec.weights, device, gguf, key)
        out[f"{key}.activations"] = activations_and_why(spec, device, weights)[0]  # load_model says why
        out[f"{key}.attention"] = resolve_attention(spec.attention, device, key)
        out[f"{key}.linear"] = resolve_linear(spec.linear, device, key)
    return out


def differences(recorded: Settings, current: Settings) -> list[tuple[str, Any, Any]]:
    """(key, the folder's value, this run's) for each key that differs. A key the record lacks came
    with a later version of the project, after the folder was made: not compared."""
    absent = "(not set)"
    return [(k, v, current.get(k, absent)) for k, v in recorded.items() if k not in current or current[k] != v]


def override(key: str, value: Any) -> str:
    """The command-line override that sets `key` to `value`."""
    group = key.removesuffix(".name")
    if key.endswith(".name") and group in ("task", "search", "decoder", "model"):
        key = group
    text = "null" if value is None else json.dumps(value) if isinstance(value, (bool, list, dict)) else str(value)
    return f"{key}={text}"


def refusal(out_dir: Path, folder: Configuration, diffs: list[tuple[str, Any, Any]]) -> str:
    named = "; ".join(f"{k}={there} there, {here} here" for k, there, here in diffs[:MAX_NAMED])
    more = f" and {len(diffs) - MAX_NAMED} more" if len(diffs) > MAX_NAMED else ""
    fix = " ".join(override(k, there) for k, there, _ in diffs[:MAX_NAMED])
    return (
        f"{out_dir} holds results of another configuration ({named}{more}; recorded in {folder.source}): "
        f"rerun with the folder's settings ({fix}{' ...' if more else ''}) to resume it, or {ANOTHER_FOLDER}"
    )


def read_record(out_dir: Path) -> Configuration | None:
    """The folder's configuration.json, or None where it has none."""
    path = out_dir / RECORD
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        settings, fingerprint = data["settings"], data["fingerprint"]
        if not isinstance(settings, dict) or not isinstance(fingerprint, str):
            raise TypeError("settings must be an object and fingerprint a string")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ResultsError(
            f"{path} cannot be read ({str(e).splitlines()[0][:120]}); restore it, or {ANOTHER_FOLDER}"
        ) from None
    return Configuration(settings, fingerprint, str(path))


def legacy_record(out_dir: Path, has_results: bool) -> Configuration | None:
    """A folder made before configuration.json: its configuration as its .hydra/config.yaml says,
    or a refusal where it holds results and nothing says which settings made them."""
    path = out_dir / LEGACY
    if not has_results:
        return None
    if not path.is_file():
        raise ConfigError(
            f"{out_dir} holds results made before runs recorded their configuration, and no {LEGACY} says "
            f"which settings made them: {ANOTHER_FOLDER}, or move its results.jsonl and trees/ aside to start it again"
        )
    try:
        container = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        assert isinstance(container, dict)
        config = Configuration.of({str(k): v for k, v in container.items()})
    except Exception as e:  # an old or hand-edited file: whatever fails, the folder's settings are unknown
        raise ConfigError(
            f"{path} (the settings of a run made before configuration.json) cannot be read "
            f"({str(e).splitlines()[0][:120]}): {ANOTHER_FOLDER}"
        ) from None
    return Configuration(config.settings, config.fingerprint, str(path))


def open_folder(out_dir: Path, current: Configuration) -> tuple[Configuration, ResultStore]:
    """The configuration the folder holds, if this run's is the same (else ConfigError naming each
    difference), and its results, read (never rewritten) and checked; a folder made before
    configuration.json gets one now, from its .hydra/config.yaml. Writes nothing for a new folder."""
    folder = read_record(out_dir)
    store = ResultStore(out_dir, folder.fingerprint if folder else None)
    if folder is None:
        try:
            folder = legacy_record(out_dir, bool(store.results.entries))
        except BackendError as e:  # the old settings name a device or format this machine cannot resolve
            raise ConfigError(f"{out_dir / LEGACY}: {e}; {ANOTHER_FOLDER}") from None
    if folder is None:
        return current, store
    diffs = differences(folder.settings, current.settings)
    if diffs:
        raise ConfigError(refusal(out_dir, folder, diffs))
    if not (out_dir / RECORD).exists():
        record(out_dir, folder)
    return folder, store


def record(out_dir: Path, config: Configuration) -> None:
    """configuration.json, written once, at the folder's first run."""
    if (out_dir / RECORD).exists():
        return
    data = {
        "fingerprint": config.fingerprint,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "from": config.source,
        "settings": config.settings,
    }
    write_atomic(out_dir / RECORD, json.dumps(data, indent=2, sort_keys=False) + "\n")
