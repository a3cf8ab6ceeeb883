"""A plug-in of any kind (drafter, search, task, architecture) is one module and its yaml: the tables
and the config are built from the modules' declarations (decoding/base/plugins.py), a bad or clashing
declaration stops the load with one line naming the module, and toy plug-ins of each kind written here
run from the command line: `decoder=toy` losslessly; `search=chain task=shouted` on a tiny Mistral
model, which the project's layers compute once its architecture module is named."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from test_cli import REPO, save_tiny_checkpoint, subprocess_env
from test_generate import PROMPTS, read, write_prompts

from conf import reference
from decoding.api.config import DecoderConfig
from decoding.api.kinds import DECODERS, DRAFTERS, SECTIONS, load
from decoding.base.errors import ConfigError
from decoding.base.plugins import Deferred, declared, table
from decoding.runtime import architectures, llama
from tasks import TaskPlugin
from tot.search import SEARCHES
from tot.search.plugin import SearchPlugin
from tot.show import load_tree

TOY = '''
"""A toy drafter: a chain repeating the sequence's last token."""

from dataclasses import dataclass

from decoding.speculation.draft_tree import ROOT, DraftTree
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

    def release(self, slots, live):
        pass

    def peak_cache_bytes(self):
        return 0


PLUGIN = DrafterPlugin(
    name="toy",
    build=lambda config, target, tokenizer, draft: ToyDrafter(config.section("toy")),
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
    assert dict(SECTIONS) == sections
    assert DecoderConfig("stand").section("stand") == sections["stand"]()
    with pytest.raises(ConfigError, match=r"decoder=toy is not one of .* named in TOT_SPEC_PLUGINS"):
        DecoderConfig("toy")


def test_the_built_in_drafters_builders_are_imported_on_first_build(tmp_path, monkeypatch):
    """Each built-in declaration defers its builder to the drafter's module ("module:function"), which
    exists; an entry "module:NAME" reads that declaration, and names it when it is missing."""
    for plugin in DRAFTERS.values():
        assert isinstance(plugin.build, Deferred)
        module, _, name = plugin.build.target.partition(":")
        assert callable(getattr(__import__(module, fromlist=[name]), name)), plugin.build.target
    monkeypatch.syspath_prepend(str(tmp_path))
    write_module(tmp_path, "two_drafters", TOY + "\nOTHER = PLUGIN\n")
    assert list(load(("two_drafters:OTHER",))) == [*DRAFTERS, "toy"]
    with pytest.raises(ConfigError, match=r"^plug-in module two_drafters declares no MISSING = "):
        load(("two_drafters:MISSING",))


def test_a_module_without_a_declaration_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, "undeclared_drafter", "X = 1\n")
    with pytest.raises(ConfigError, match=r"^plug-in module undeclared_drafter declares no PLUGIN") as e:
        load((name,))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "body", ["raise RuntimeError('no config here\\nsecond line')", "import not_a_module_at_all", "1/0"]
)
def test_a_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, body):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, "broken_drafter", body + "\n")
    with pytest.raises(
        ConfigError, match=r"^plug-in module broken_drafter cannot be imported \(.*TOT_SPEC_PLUGINS$"
    ) as e:
        load((name,))
    assert "\n" not in str(e.value)


def test_a_module_that_fails_to_import_stops_a_command_with_exit_2(tmp_path):
    write_module(tmp_path, "broken_drafter", "raise RuntimeError('boom')\n")
    env = subprocess_env()
    env.update(TOT_SPEC_PLUGINS="broken_drafter", PYTHONPATH=f"{tmp_path}:{env.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "tot.solve", "model=smollm2-135m", "data.limit=1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "plug-in module broken_drafter cannot be imported (RuntimeError: boom)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_two_modules_claiming_one_name_fail_naming_the_second(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    clash = TOY.replace('name="toy"', 'name="pld"').replace(
        'DecoderKind("toy", "batch", "toy"', 'DecoderKind("x", "batch", "pld"'
    )
    name = write_module(tmp_path, "clashing_drafter", clash)
    with pytest.raises(ConfigError, match=r"^plug-in module clashing_drafter: drafter pld is already declared by "):
        load((name,))
    decoder_clash = TOY.replace('DecoderKind("toy"', 'DecoderKind("ar"')
    name = write_module(tmp_path, "clashing_decoder", decoder_clash)
    with pytest.raises(ConfigError, match=r"^plug-in module clashing_decoder: decoder ar is already declared by "):
        load((name,))


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


CHAIN = '''
"""A toy search: one chain, the first thought at each depth, at most `search.steps` of them."""

from dataclasses import dataclass, replace

from tot.search.base import SearchBase
from tot.search.plugin import SearchPlugin


@dataclass(frozen=True)
class ChainSettings:
    steps: int = 8

    def scaled(self, n):
        return replace(self, steps=n)


class Chain(SearchBase):
    async def solve(self, problem, engine):
        thinker = self.thinker(problem, engine)
        node = thinker.tree.root
        for depth in range(1, min(self.task.depth, self.settings.steps) + 1):
            node = (await thinker.grow([(node, 1, "")], f"d{depth}"))[0]
            thinker.tree[node].chosen = True
            if thinker.tree[node].terminal:
                break
        return thinker.solution(node)


PLUGIN = SearchPlugin(name="chain", build=Chain, options=ChainSettings)
'''

SHOUTED = '''
"""A toy task on the template contract: questions upper-cased (task.shout=false keeps them); what a
problem is (JSONL of question/answer, the answer after "The answer is") and how it is prompted come
from tasks.template."""

from dataclasses import dataclass, replace

from tasks import TaskPlugin
from tasks.template import TemplateTask


@dataclass
class Shouted(TemplateTask):
    name: str = "shouted"
    depth: int = 2
    shout: bool = True

    def load(self, data):
        return [replace(p, question=p.question.upper()) if self.shout else p for p in super().load(data)]


PLUGIN = TaskPlugin(name="shouted", build=Shouted, options=Shouted)
'''

MISTRAL = '''
"""Mistral without a sliding window: Llama's layers under other classes."""

from transformers.models.mistral import modeling_mistral

from decoding.runtime.architectures.plugin import ArchitecturePlugin

PLUGIN = ArchitecturePlugin(
    name="mistral",
    build=modeling_mistral.MistralForCausalLM,
    decoder_layer=modeling_mistral.MistralDecoderLayer,
    rms_norm=modeling_mistral.MistralRMSNorm,
    mlp=modeling_mistral.MistralMLP,
)
'''

YAMLS = {
    "search/chain.yaml": "# One chain of thoughts.\nname: chain\nsteps: 8  # the most thoughts\n",
    "task/shouted.yaml": "# Questions upper-cased.\nname: shouted\ndepth: 2\nshout: true\n",
}


def test_every_kind_declares_through_one_mechanism(tmp_path, monkeypatch):
    """The built-in tables hold their kinds; a module declaring another kind in a table's built-in
    list, or two claiming one name, fail naming the module; an extra module joins its kind's table only."""
    assert set(SEARCHES) == {"bfs", "dvts", "best_of_n", "mcts"}
    assert {"llama", "qwen2"} <= set(architectures.ARCHITECTURES)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_module(tmp_path, "toy_chain", CHAIN)
    write_module(tmp_path, "toy_shouted", SHOUTED)
    with pytest.raises(ConfigError, match=r"^plug-in module toy_chain declares a search, not a task$"):
        declared(TaskPlugin, ("toy_chain",))
    assert list(declared(TaskPlugin, (), ("toy_chain", "toy_shouted"))) == ["shouted"]
    assert list(table(SearchPlugin, ("tot.search.bfs",), environ={"TOT_SPEC_PLUGINS": "toy_shouted, toy_chain"})) == [
        "bfs",
        "chain",
    ]
    write_module(tmp_path, "toy_bfs", CHAIN.replace('name="chain"', 'name="bfs"'))
    already = r"^plug-in module toy_bfs: search bfs is already declared by tot.search.bfs$"
    with pytest.raises(ConfigError, match=already):
        declared(SearchPlugin, ("tot.search.bfs",), ("toy_bfs",))


def test_toy_search_task_and_architecture_run_from_the_command_line(tmp_path):
    """Three modules on PYTHONPATH named in TOT_SPEC_PLUGINS and two yamls on a Hydra search path:
    `search=chain task=shouted` runs on a tiny Mistral model through the project's layers (the load
    log says so; without its module transformers' forward), and builds hf's tree."""
    from conftest import build_model, build_tokenizer

    for name, source in (("toy_chain", CHAIN), ("toy_shouted", SHOUTED), ("toy_mistral", MISTRAL)):
        write_module(tmp_path, name, source)
    for path, text in YAMLS.items():
        (tmp_path / "conf" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / path).write_text(text)
    data = tmp_path / "problems.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n")
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), max_positions=4096, arch="mistral")
    assert "no architecture plug-in" in llama.forward_path(model)
    ckpt = tmp_path / "mistral"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    env = subprocess_env()
    env.update(
        TOT_SPEC_PLUGINS="toy_chain,toy_shouted,toy_mistral", PYTHONPATH=f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    )
    trees = {}
    for decoder in ("ar", "hf"):
        out = tmp_path / decoder
        cmd = [sys.executable, "-m", "tot.solve", "search=chain", "task=shouted", "search.steps=2", "task.shout=true"]
        cmd += [f"decoder={decoder}", f"model.path={ckpt}", f"data.path={data}", "gen.max_thought_tokens=6"]
        cmd += ["gen.max_eval_tokens=3", f"hydra.run.dir={out}", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "the project's layers (mistral)" in proc.stdout + proc.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["task"], summary["search"], summary["config"]["chain"]) == ("shouted", "chain", {"steps": 2})
        record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
        tree = load_tree(out, record["id"])
        assert len(tree.thoughts) >= 2
        trees[decoder] = [(t.text, t.value) for _, t in sorted(tree.thoughts.items())]
    assert trees["ar"] == trees["hf"]


def test_every_options_dataclass_defaults_to_what_the_yaml_says():
    """Defaults are written twice, in the options' dataclasses (the Python API) and in conf/ (the
    command line): a user of either gets the same product."""
    from dataclasses import MISSING, fields

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from decoding.api.server import ServerOptions
    from decoding.runtime.models import ModelSpec
    from decoding.schedules.rounds import RoundsOptions
    from decoding.speculation.options import VerifyOptions
    from decoding.trees.policies import DraftTreeOptions

    with initialize_config_module(config_module="conf", version_base="1.3"):
        config = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    sections = {
        "verify": [VerifyOptions],
        "draft_tree": [DraftTreeOptions],
        "seed": [RoundsOptions],
        **{name: [options] for name, options in SECTIONS.items()},
        "server": [ServerOptions],
        "model": [ModelSpec],
    }
    named_by_code = {"key", "vocab"}  # the section a message names; the draft model's vocabulary
    differ, compared = [], 0
    for section, classes in sections.items():
        yaml = config[section]
        for options in classes:
            for f in fields(options):
                if f.name in named_by_code and f.name not in yaml:
                    continue
                assert f.name in yaml, f"{section}.{f.name} is not in conf/"
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                if (list(default) if isinstance(default, tuple) else default) != yaml[f.name]:
                    differ.append(f"{section}.{f.name}: {options.__name__} {default!r}, conf/ {yaml[f.name]!r}")
                compared += 1
    assert not differ
    assert compared > 40


def test_the_searches_tasks_and_run_options_default_to_what_the_yaml_says():
    """The same for what a run reads beside the decoder: each search's settings (conf/search/), each
    task's options (conf/task/), the problems' selection, the sampling settings, the vote and the reward
    model's options."""
    from dataclasses import MISSING, fields

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from tasks import TASKS
    from tasks.base import DataSpec
    from tot.search.base import GenSettings
    from tot.search.reward import RewardSpec
    from tot.search.vote import VoteRule

    def composed(*overrides: str) -> dict:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            return OmegaConf.to_container(compose(config_name="config", overrides=list(overrides)), resolve=True)

    base = composed()
    pairs = [(f"search={name}", "search", plugin.options) for name, plugin in SEARCHES.items()]
    pairs += [(f"task={name}", "task", plugin.options) for name, plugin in TASKS.items()]
    # The sampling settings' own defaults, not the temperature GSM8K (the default task) sets for itself.
    pairs += [("", "data", DataSpec), ("~task.temperature", "gen", GenSettings), ("", "vote", VoteRule)]
    pairs += [("", "reward", RewardSpec)]
    run_keys = {"name", "depth", "model", "judge_metric"}  # read by the run, computed, or a name the code gives
    differ, missing, compared = [], [], 0
    for override, section, options in pairs:
        yaml = (composed(override) if override else base)[section]
        for f in fields(options):
            if f.name in run_keys or f.name.startswith("_") or not f.init:
                continue
            if f.name not in yaml:
                missing.append(f"{override or section}: {f.name}")
                continue
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            if (list(default) if isinstance(default, tuple) else default) != yaml[f.name]:
                differ.append(f"{override or section}.{f.name}: {options.__name__} {default!r}, conf/ {yaml[f.name]!r}")
            compared += 1
    assert not missing and not differ, (missing, differ)
    assert compared > 40
