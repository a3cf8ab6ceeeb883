"""A drafter is one module and its yaml: the tables and the config are built from the modules'
declarations, a bad or clashing declaration stops the import with one line naming the module, and a
toy drafter written here runs from the command line as `decoder=toy`, losslessly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest
from test_cli import REPO, save_tiny_checkpoint, subprocess_env
from test_generate import PROMPTS, read, write_prompts

from conf import reference
from decoding.config import DecoderConfig
from decoding.core.errors import ConfigError
from decoding.kinds import DECODERS, DRAFTERS, MODULES, build_tables

TOY = '''
"""A toy drafter: a chain repeating the sequence's last token."""

from dataclasses import dataclass

from decoding.core.draft_tree import ROOT, DraftTree
from decoding.drafters.plugin import DecoderKind, DrafterPlugin


@dataclass(frozen=True)
class ToyOptions:
    depth: int = 2


class ToyDrafter:
    learns_top = 0

    def __init__(self, options: ToyOptions) -> None:
        self.max_nodes = options.depth

    def admit(self, slots):
        pass

    def draft(self, slots):
        trees = []
        for slot in slots:
            tree, parent = DraftTree(draw="top"), ROOT
            last = (slot.seq.prompt + slot.seq.generated)[-1]
            for _ in range(min(self.max_nodes, slot.seq.room)):
                parent = tree.add(last, parent)
            trees.append(tree)
        return trees

    def update(self, slots, verdicts):
        pass

    def release(self, slots):
        pass

    def peak_cache_bytes(self):
        return 0


PLUGIN = DrafterPlugin(
    name="toy",
    build=lambda config, target, tokenizer, draft: ToyDrafter(config.toy),
    options=ToyOptions,
    section="toy",
    decoders=(DecoderKind("toy", "batch", "toy", ("toy", "verify")),),
)
'''

TOY_YAML = """\
# @package _global_
# The toy drafter: the last token, repeated. Options: toy.*
decoder:
  name: toy

toy:
  depth: 2   # chain length
"""


def write_module(root, name: str, source: str) -> str:
    (root / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def test_tables_and_config_come_from_the_declarations():
    assert set(DRAFTERS) == {"none", "model", "stand", "suffix", "pld", "recycling", "aded"}
    assert {k.drafter for k in DECODERS.values()} <= set(DRAFTERS)
    sections = {p.section: p.options for p in DRAFTERS.values() if p.options is not None}
    config = {f.name: f.type for f in fields(DecoderConfig)}
    assert all(config[s] is o for s, o in sections.items())
    assert DecoderConfig("stand").stand == sections["stand"]()
    with pytest.raises(ConfigError, match=r"decoder=toy is not one of .* named in TOT_SPEC_PLUGINS"):
        DecoderConfig("toy")


def test_a_module_without_a_declaration_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, "undeclared_drafter", "X = 1\n")
    with pytest.raises(ConfigError, match=r"^plug-in module undeclared_drafter declares no PLUGIN") as e:
        build_tables((*MODULES, name))
    assert "\n" not in str(e.value)


def test_two_modules_claiming_one_name_fail_naming_the_second(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    clash = TOY.replace('name="toy"', 'name="pld"').replace(
        'DecoderKind("toy", "batch", "toy"', 'DecoderKind("x", "batch", "pld"'
    )
    name = write_module(tmp_path, "clashing_drafter", clash)
    with pytest.raises(ConfigError, match=r"^plug-in module clashing_drafter: drafter pld is already declared by "):
        build_tables((*MODULES, name))
    decoder_clash = TOY.replace('DecoderKind("toy"', 'DecoderKind("ar"')
    name = write_module(tmp_path, "clashing_decoder", decoder_clash)
    with pytest.raises(ConfigError, match=r"^plug-in module clashing_decoder: decoder ar is already declared by "):
        build_tables((*MODULES, name))


def test_a_toy_drafter_runs_from_the_command_line_as_ar_does(tmp_path, tiny_model, tokenizer):
    """One module (on PYTHONPATH, named in TOT_SPEC_PLUGINS) and its yaml (a Hydra search path's
    decoder/toy.yaml): `decoder=toy` gives ar's greedy tokens."""
    write_module(tmp_path, "toy_drafter", TOY)
    (tmp_path / "conf" / "decoder").mkdir(parents=True)
    (tmp_path / "conf" / "decoder" / "toy.yaml").write_text(TOY_YAML)
    ckpt = save_tiny_checkpoint(tmp_path / "tiny", tiny_model, tokenizer)
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    env = subprocess_env()
    env.update(TOT_SPEC_PLUGINS="toy_drafter", PYTHONPATH=f"{tmp_path}:{env.get('PYTHONPATH', '')}")
    base = [f"prompts={prompts}", f"model.path={ckpt}", "gen.max_new_tokens=8"]
    runs = {
        "ar": ["decoder=ar"],
        "toy": ["decoder=toy", "toy.depth=3", "verify.plan=fixed", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"],
    }
    summaries = {}
    for name, args in runs.items():
        out = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "decoding.generate", *base, f"out={out}", *args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        summaries[name] = json.loads(out.with_name(out.name + ".summary.json").read_text())
    assert [r["token_ids"] for r in read(tmp_path / "toy.jsonl")] == [
        r["token_ids"] for r in read(tmp_path / "ar.jsonl")
    ]
    assert summaries["toy"]["decoder"] == "toy" and summaries["toy"]["drafted_tokens"] > 0


def test_a_plugin_yamls_options_are_in_the_reference(tmp_path):
    (tmp_path / "decoder").mkdir()
    (tmp_path / "decoder" / "toy.yaml").write_text(TOY_YAML)
    text = reference.render_decoders(tmp_path)
    assert "| `toy` | The toy drafter: the last token, repeated. Options: toy.* |" in text
    assert "| `toy.depth` | `2` | chain length |" in text and "decoder.name" not in text
