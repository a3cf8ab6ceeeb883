"""What every search is built on: the sampling settings, a problem's growing and valuing of thoughts (`Thinker`),
the phases' decode costs, and `SearchBase` (the searches: tot/search/bfs.py, dvts.py, best_of_n.py, mcts.py).

A search is a coroutine: it submits requests and awaits them, so that several problems run at once
over one engine and the engine's batch stays full. Each thought is its own request, and its
evaluation is sent as soon as that thought is done, beside the other thoughts still decoding; the
n samples of one state share a `group` (the same prompt, n trajectories). The tree does not depend
on the order in which requests finish: node ids are given in request order before any is sent, and
each request's seed comes from its place in the tree.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import networkx as nx

from decoding import Completion, ConfigError, DecodeStats, GenRequest, GenResult, Group
from decoding import run_sync as run_sync  # searches are run with it
from tasks.base import FullTask, Problem, Prompt, Task, Values
from tot.search.confidence import TOP_NEEDED, mean_probability, readings
from tot.search.reward import Discriminator, ProcessReward, ScoringModel
from tot.search.tree import ReasoningTree, Valuation
from tot.search.value import read_value
from tot.search.vote import PLAIN_VOTE, Ballot, VoteRule, settled, tally, weights

PHASES = ("generate", "evaluate", "rollout")
# How a search's answer is chosen among its finished states (search.aggregate): the best-valued one, or
# the answer with the largest summed value over them (a value-weighted vote, as search-and-learn's).
Aggregate = Literal["best", "vote"]
# An evaluator prompt for a path: (its steps, whether asked as a follow-up in its reply's context).
EvalPrompt = Callable[[list[str], bool], Prompt]


@dataclass(frozen=True)
class GenSettings:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_thought_tokens: int = 128
    max_eval_tokens: int = 128
    eval_temperature: float = 0.7

    def request(
        self,
        prompt: Prompt,
        group: Group,
        seed: int,
        evaluate: bool = False,
        context: tuple[int, ...] = (),
        keep: bool = False,
        max_new_tokens: int | None = None,
        choices: tuple[str, ...] = (),
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> GenRequest:
        """The request for a thought (or, with evaluate, for a state evaluation: with `context`, a
        follow-up turn of the thought's own reply; `keep` holds a thought's keys and values for it;
        `choices`, the evaluator's answers scored in one forward in place of a reply).
        `max_new_tokens` overrides the phase's limit (a whole solution is longer than a thought)."""
        default = self.max_eval_tokens if evaluate else self.max_thought_tokens
        return GenRequest(
            prompt=prompt.text,
            prefix=prompt.prefix,
            stop=prompt.stop,
            max_new_tokens=max_new_tokens or default,
            temperature=self.eval_temperature if evaluate else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            group=group,
            seed=seed,
            context=context,
            keep=keep,
            choices=choices,
            logprobs=logprobs,
            top_logprobs=top_logprobs if logprobs else 0,
        )


@dataclass
class PhaseStats:
    """Decode cost of one phase (thought generation or state evaluation): its calls' shares of the
    engine's steps; `engine_s` is their time (phases and problems overlap in wall-clock time)."""

    decode: DecodeStats = field(default_factory=DecodeStats)
    calls: int = 0

    @property
    def engine_s(self) -> float:
        return self.decode.draft_s + self.decode.verify_s + self.decode.other_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.decode.generated_tokens,
            "engine_s": self.engine_s,
            "calls": self.calls,
            **{f"decode_{k}": v for k, v in self.decode.to_dict().items()},
        }


@dataclass
class Solution:
    answer: str
    tree: ReasoningTree
    phases: dict[str, PhaseStats]
    steps: list[str] = field(default_factory=list)  # the answer path's thoughts
    # A budget spent in waves (search.stop): the samples drawn and the budget's whole count.
    budget: dict[str, int] = field(default_factory=dict)


class GenerationEngine(Protocol):
    """What a search needs of an engine: a call it can await beside other calls, returning the
    results and the call's share of the cost (decoding.Engine, or a scripted fake in the tests)."""

    async def agenerate(self, requests: list[GenRequest]) -> Completion: ...


# A reward model (reward.path): a judge's engine, a classifier / PRM scoring paths itself, or a
# discriminator completing them (mutual consistency).
Reward = GenerationEngine | ScoringModel | ProcessReward | Discriminator


class Search(Protocol):
    async def solve(self, problem: Problem, engine: GenerationEngine) -> Solution: ...


def check_positive(search: str, **values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ConfigError(f"search.{key}={value} must be a positive integer (search={search})")


def request_seed(seed: int, *parts: object) -> int:
    """A request's seed from the run seed and where it sits in the tree: a resumed run samples
    exactly what an uninterrupted one would have."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())


class Thinker:
    """Thought generation and state evaluation for one problem's tree, each call's cost added to
    its phase's stats."""

    def __init__(
        self,
        task: Task,
        values: Values,
        gen: GenSettings,
        seed: int,
        problem: Problem,
        engine: GenerationEngine,
        reward: Reward | None = None,
        vote: VoteRule = PLAIN_VOTE,
    ) -> None:
        self.task, self.values, self.gen, self.seed, self.problem = task, values, gen, seed, problem
        self.engine, self.reward, self.vote = engine, reward, vote
        self.tree = ReasoningTree(problem.question)
        self.phases = {p: PhaseStats() for p in PHASES}
        mode = values.mode
        # task.value=confidence: a thought is valued by its own tokens' probabilities, asked with it; no
        # evaluator is asked, so none follows a thought up (its context is not kept for one). A reward
        # model (reward.path) values states in its place.
        self.confident = mode == "confidence" and reward is None
        # task.value=rollout: a state is valued by completions sampled from it to an answer, and each
        # completion is a ballot of the problem's vote (`revalue`).
        self.rollouts = mode == "rollout" and reward is None
        self.in_context = values.in_context and not self.confident and not self.rollouts
        # Replies that may finish a path come with their log-probabilities where a value or the vote reads them.
        self.logprobs = self.confident or vote.reading is not None
        self.top_logprobs = TOP_NEEDED if vote.reading == "tail_margin" else 0
        self._replies: dict[int, tuple[int, ...]] = {}  # node -> its thought's whole sequence, until valued
        self._confidence: dict[int, float] = {}  # node -> its thought's mean token probability, until valued

    @property
    def tokens(self) -> int:
        """The tokens this problem's requests have generated so far, every phase's."""
        return sum(p.decode.generated_tokens for p in self.phases.values())

    def siblings(self, label: str | Group) -> Group:
        """The requests of this problem's search round `label` (say "d2": the thoughts or evaluations
        of depth 2) as the engine pools them: siblings share the drafters' cross-trajectory statistics.
        A `Group` given is kept as it is (search plug-ins that built their own)."""
        return label if isinstance(label, Group) else Group(self.problem.id, label)

    async def grow(self, parents: list[tuple[int, int, str]], label: str | Group, together: bool = False) -> list[int]:
        """Sample n thoughts from each (state, n, seed key) of search round `label`, and value each
        thought as soon as it is done. Siblings, as the engine pools them: the thoughts of one state
        (`together`: all of the round's thoughts), and the round's evaluations ("<label>/eval"; a
        `Group` given for `label` is the evaluations' group, as plug-ins passed it). Returns the new
        nodes in request order."""
        task, gen, tree, pid = self.task, self.gen, self.tree, self.problem.id
        eval_group = label if isinstance(label, Group) else self.siblings(f"{label}/eval")
        group = self.siblings(label) if together and not isinstance(label, Group) else None
        thoughts = []
        for state, n, key in parents:
            prompt = task.generator_prompt(self.problem, tree.steps(state))
            for i in range(n):
                seed = request_seed(self.seed, pid, state, *([key] if key else []), i)
                child = tree.add(state, "", raw="", tokens=0)  # its id fixed before anything runs
                request = gen.request(
                    prompt,
                    group=group or self.siblings(str(state)),
                    seed=seed,
                    keep=self.in_context,
                    logprobs=self.logprobs,
                    top_logprobs=self.top_logprobs,
                )
                thoughts.append((child, request))
        sampled = await asyncio.gather(*(self._thought(child, request, eval_group) for child, request in thoughts))
        if self.rollouts:
            # Added in thought order once all are in, and valued by the vote as it stands after them:
            # the tree does not depend on which reply finished first.
            for (child, _), completions in zip(thoughts, sampled):
                for text, tokens, read in completions:
                    self.tree.add(child, text, raw=text, tokens=tokens, terminal=True, rollout=True, confidence=read)
            self.revalue()
        return [child for child, _ in thoughts]

    async def foresee(self, parents: list[tuple[int, int, str]]) -> list[int]:
        """task.value=rollout, foresight (phi-Decoding's): each (state, n, seed key)'s n thoughts are the
        first steps of n completions sampled from it to an answer, the rest of each completion below its
        thought as that thought's one completion: a thought and its value for the tokens of one
        completion. A thought that ends its path (or a completion with no step after it) is the ballot
        itself. Returns the new thoughts in request order, valued against the vote after them all."""
        task, tree, pid = self.task, self.tree, self.problem.id
        asked = []
        for state, n, key in parents:
            steps = tree.steps(state)
            prompt = self.values.rollout_prompt(self.problem, steps)
            stops = task.generator_prompt(self.problem, steps).stop
            for i in range(n):
                child = tree.add(state, "", raw="", tokens=0, value=0.0)  # its id fixed before anything runs
                request = self.gen.request(
                    prompt,
                    group=self.siblings(str(state)),
                    seed=request_seed(self.seed, pid, state, *([key] if key else []), "foresee", i),
                    max_new_tokens=self.values.rollout_tokens,
                    logprobs=self.logprobs,
                    top_logprobs=self.top_logprobs,
                )
                asked.append((child, request, stops))
        outs = await asyncio.gather(*(self.call([request], "rollout") for _, request, _ in asked))
        for (child, _, stops), (out,) in zip(asked, outs):
            head, rest = split_at_stop(out.text, stops)
            node = tree[child]
            node.text = task.parse_thought(self.problem, tree.steps(child)[:-1], head)
            node.raw = head
            node.terminal = self.finished(child)
            read = readings(out.logprobs) if out.logprobs is not None else None
            if node.terminal or not rest.strip():
                node.tokens, node.confidence = out.stats.generated_tokens, read
                node.terminal = True  # nothing follows it: its answer is its completion's
            else:
                tokens = out.stats.generated_tokens
                tree.add(child, rest.strip(), raw=rest, tokens=tokens, terminal=True, rollout=True, confidence=read)
        self.revalue()
        return [child for child, _, _ in asked]

    async def _thought(
        self, child: int, request: GenRequest, eval_group: Group
    ) -> list[tuple[str, int, dict[str, float] | None]]:
        """Write one thought, then value it (task.value=rollout: sample its completions, returned)."""
        (out,) = await self.call([request], "generate")
        steps = self.tree.steps(child)[:-1]
        node = self.tree[child]
        node.text = self.task.parse_thought(self.problem, steps, out.text)
        node.raw, node.tokens = out.text, out.stats.generated_tokens
        node.terminal = self.finished(child)
        read = None if out.logprobs is None else readings(out.logprobs)
        node.confidence = read
        if self.in_context:
            self._replies[child] = out.context
        if self.confident:
            assert read is not None, "task.value=confidence asks every thought's log-probabilities"
            self._confidence[child] = read["mean"]  # confidence(out), read once
        if self.rollouts:
            return [] if node.terminal else await self.complete(child)
        await self.evaluate([child], eval_group)
        return []

    async def complete(self, node: int) -> list[tuple[str, int, dict[str, float] | None]]:
        """task.rollouts completions of node's path to an answer: each (its text, tokens, readings), in
        order. They continue the prompt node's own thoughts will be sampled from, in its group: they
        share its keys and values and teach the drafters what its children will say."""
        values, pid = self.values, self.problem.id
        prompt = values.rollout_prompt(self.problem, self.tree.steps(node))
        requests = [
            self.gen.request(
                prompt,
                group=self.siblings(str(node)),
                seed=request_seed(self.seed, pid, node, "rollout", j),
                max_new_tokens=values.rollout_tokens,
                logprobs=self.logprobs,
                top_logprobs=self.top_logprobs,
            )
            for j in range(values.rollouts)
        ]
        outs = await self.call(requests, "rollout")
        return [
            (o.text.strip(), o.stats.generated_tokens, readings(o.logprobs) if o.logprobs is not None else None)
            for o in outs
        ]

    def ballot(self, node: int) -> Ballot:
        """A finished state as a ballot: its answer, value and its path's confidence (`path_confidence`)."""
        tree = self.tree
        answer = self.task.answer(self.problem, tree.steps(node))
        return Ballot(answer, tree[node].value, path_confidence(tree, node))

    def revalue(self) -> None:
        """task.value=rollout: every state valued anew by the vote as it stands: the (weighted) share of its
        completions whose answer is the problem's plurality; a finished state, and a completion, 1 where
        its own answer is it, else 0. Values of one tree are so always read against one plurality."""
        tree = self.tree
        ballots = {s: self.ballot(s) for s in finished_states(tree)}
        leader = tally(self.vote, [b for b in ballots.values() if b.answer], "one").winner
        for s, b in ballots.items():
            tree[s].value = float(bool(leader) and b.answer == leader)
        for n in tree.graph.nodes:
            completions = tree.rollouts(n)
            if not completions:
                continue
            counted = [w or 0.0 for w in weights(self.vote, [ballots[c] for c in completions], "one")]
            agree = sum(w for c, w in zip(completions, counted) if ballots[c].answer == leader)
            tree[n].value = agree / sum(counted) if sum(counted) > 0 else 0.0
            reached = sum(ballots[c].answer == leader for c in completions)
            tree[n].evaluation = f"{reached} of {len(completions)} completions answer {leader or '(none yet)'}"

    async def evaluate(self, nodes: list[int], group: Group) -> None:
        """Value each node by the task's state evaluator; with task.evaluator=in_context, asked as a
        follow-up turn of the reply that wrote the node."""

        def prompt(steps: list[str], follow_up: bool) -> Prompt:
            prompts = self.values.prompts
            ask = prompts.follow_up_prompt if follow_up else prompts.evaluator_prompt
            return ask(self.problem, steps)

        await asyncio.gather(*(self.value(c, prompt, group, c) for c in nodes))

    async def value(self, node: int, prompt: EvalPrompt, group: Group, key: object) -> None:
        """Value a node of the tree (its reply's context, if kept, asked in)."""
        context = self._replies.pop(node, ())
        sure = self._confidence.pop(node, None)
        self.tree[node].take(await self.judge(self.tree.steps(node), context, prompt, group, key, sure))

    async def judge(
        self,
        steps: list[str],
        context: tuple[int, ...],
        prompt: EvalPrompt,
        siblings: str | Group,
        key: object,
        confidence: float | None = None,
    ) -> Valuation:
        """The valuation of the path `steps`: its value, the mean of task.n_evaluate evaluator
        samples of prompt(steps, whether asked in the reply's `context`), all in one call, seeded by
        `key` (the path's place in the search), pooled with the search round `siblings`' other
        evaluations, and the evaluation that gave it; with task.value
        expected or yes, read from the evaluator's answers' probabilities after the prompt instead;
        with confidence, the `confidence` of the reply that wrote the path's last step."""
        if isinstance(self.reward, ScoringModel | ProcessReward):
            if isinstance(self.reward, ProcessReward):
                scored, cost = await self.reward.score(self.problem.question, steps)
                self.phases["evaluate"].decode += cost
            else:
                scored = self.reward.score(self.problem.question, steps)
            self.phases["evaluate"].calls += 1
            steps_scored = list(scored.steps) if scored.steps else None  # a PRM's step scores
            return Valuation(scored.value, f"reward {scored.value:.4f}", reward_steps=steps_scored)
        if isinstance(self.reward, Discriminator):
            answer = self.task.answer(self.problem, steps) if self.ends(steps) else None
            return await self.discriminate(steps, answer, key)
        if self.confident:
            assert confidence is not None, "task.value=confidence values a reply by its own tokens: pass `confidence`"
            return Valuation(confidence, f"mean token probability {confidence:.4f} (no evaluator asked)")
        values, pid = self.values, self.problem.id
        asked = prompt(steps, bool(context))
        # A judge under task.value=confidence reads the evaluator's reply, as under sampled.
        worth = {} if values.mode in ("sampled", "confidence") else values.prompts.value_answers()
        k = 1 if worth else values.n_evaluate  # a forward's distribution is read once
        requests = [
            self.gen.request(
                asked,
                group=self.siblings(siblings),
                # Sample 0 keeps the seed a single evaluation always had.
                seed=request_seed(self.seed, pid, key, "eval", *([j] if j else [])),
                evaluate=True,
                context=context,
                choices=tuple(worth),
            )
            for j in range(k)
        ]
        # A judge (reward.kind=judge) answers the task's evaluator prompt on its own engine.
        results = await self.call(requests, "evaluate", self.reward)
        in_context = True if context else None
        if worth:  # task.value=expected or yes: read from the answers' probabilities, nothing generated
            logprobs = results[0].choice_logprobs
            assert logprobs is not None, "a choice request's result carries its answers' log-probabilities"
            read = read_value(worth, logprobs)
            return Valuation(read.value, None, asked.text, in_context, distribution=read.distribution)
        texts = [o.text for o in results]
        value = sum(map(values.prompts.parse_value, texts)) / k
        spent = sum(o.stats.generated_tokens for o in results)
        return Valuation(value, texts[0] if k == 1 else texts, asked.text, in_context, eval_tokens=spent)

    async def discriminate(self, steps: list[str], answer: str | None, key: object) -> Valuation:
        """reward.kind=consistency (rStar's mutual consistency): the reward model completes the path from
        its shown paragraphs (reward.hint), reward.completions times; the value is the share of those
        completions whose answer is `answer`, the path's own. A path with no answer yet (None) is completed
        from all its paragraphs, its value the share reaching the completions' most frequent answer."""
        reward = self.reward
        assert isinstance(reward, Discriminator), "discriminate is reward.kind=consistency's valuation"
        task, pid = self.task, self.problem.id
        shown = reward.shown(steps, answered=answer is not None)
        prompt = self.values.rollout_prompt(self.problem, shown)
        requests = [
            self.gen.request(
                prompt,
                group=self.siblings("consistency"),
                seed=request_seed(self.seed, pid, key, "consistency", j),
                max_new_tokens=reward.spec.max_tokens,
            )
            for j in range(reward.spec.completions)
        ]
        outs = await self.call(requests, "evaluate", reward.engine)
        answers = [task.answer(self.problem, [*shown, o.text.strip()]) for o in outs]
        if answer is None:
            stated = [a for a in answers if a]
            answer = max(stated, key=stated.count) if stated else ""
        agree = sum(bool(a) and a == answer for a in answers)
        said = f"{agree} of {len(answers)} completions from paragraph {len(shown) + 1} answer {answer or '(none)'}"
        return Valuation(agree / len(answers), said, eval_tokens=sum(o.stats.generated_tokens for o in outs))

    def finished(self, node: int) -> bool:
        """A path ends at the depth limit or where the task says it is complete."""
        return self.ends(self.tree.steps(node))

    def ends(self, steps: list[str]) -> bool:
        return len(steps) >= self.task.depth or self.task.is_terminal(self.problem, steps)

    def solution(self, best: int) -> Solution:
        self.tree.mark_answer(best)
        steps = self.tree.steps(best)
        return Solution(self.task.answer(self.problem, steps), self.tree, self.phases, steps)

    async def call(
        self, requests: list[GenRequest], phase: str, engine: GenerationEngine | None = None
    ) -> list[GenResult]:
        done = await (engine or self.engine).agenerate(requests)
        self.phases[phase].decode += done.stats
        self.phases[phase].calls += 1
        return done.results


S = TypeVar("S", bound="SearchBase")


class SearchBase:
    """What every search is built from: the task (its `Task` members), how its states are valued
    (`Values`: task.value, its options and the task's evaluator prompts), the search's settings, the
    sampling settings, the run seed, the reward model, if any (reward.path: it values states in place of
    the task's evaluator), and how the problem's vote weighs its ballots (vote.*)."""

    def __init__(
        self,
        task: Task,
        values: Values,
        settings: Any,
        gen: GenSettings,
        seed: int,
        reward: Reward | None = None,
        vote: VoteRule = PLAIN_VOTE,
    ) -> None:
        self.task, self.values, self.settings, self.gen, self.seed = task, values, settings, gen, seed
        self.reward, self.vote = reward, vote

    @classmethod
    def over(
        cls: type[S],
        task: FullTask,
        settings: Any,
        gen: GenSettings,
        seed: int,
        reward: Reward | None = None,
        vote: VoteRule = PLAIN_VOTE,
    ) -> S:
        """The search over a task module's task, its states valued as the task's options say."""
        return cls(task, Values.of(task), settings, gen, seed, reward, vote)

    def thinker(self, problem: Problem, engine: GenerationEngine) -> Thinker:
        """The one problem's thoughts: its tree, grown and valued through `engine`."""
        return Thinker(self.task, self.values, self.gen, self.seed, problem, engine, self.reward, self.vote)


def choose(
    tree: ReasoningTree,
    leaves: list[int],
    answer_of: Callable[[int], str],
    aggregate: str,
    vote: VoteRule = PLAIN_VOTE,
) -> int:
    """The state whose answer wins: the best value, or the answer of the largest summed weight (`vote`:
    each state's value; `majority`: 1 a state; vote.weight: a confidence reading in place of either;
    ties: more states, then the earlier one); within the answer, its best-valued state."""
    if aggregate == "best":
        return max(leaves, key=tree.value)
    ballots = ballots_of(tree, leaves, answer_of)
    winner = tally(vote, ballots, "one" if aggregate == "majority" else "value").winner
    # Where no finished state stated an answer (no winner), the best of them all.
    return max([s for s, b in zip(leaves, ballots) if b.answer == winner] or leaves, key=tree.value)


def vote_settled(
    tree: ReasoningTree, answer_of: Callable[[int], str], vote: VoteRule, stop: str, counted: int, remaining: int
) -> bool:
    """search.stop between a tree search's rounds: whether at most `remaining` ballots still to come
    cannot change the vote over the finished states (`decided`), or (`agree`) the round's new ballots,
    those past the first `counted` (node order: a round's come last), two or more, all name its leader."""
    if stop == "never":
        return False
    finished = finished_states(tree)
    new = len(finished) - counted
    return settled(vote, ballots_of(tree, finished, answer_of), "value", remaining, stop, new if new >= 2 else 0)


def ballots_of(tree: ReasoningTree, leaves: list[int], answer_of: Callable[[int], str]) -> list[Ballot]:
    """Each finished state's ballot: its answer, value and its path's confidence readings."""
    return [Ballot(answer_of(s), tree[s].value, path_confidence(tree, s)) for s in leaves]


def path_confidence(tree: ReasoningTree, node: int) -> dict[str, float] | None:
    """The confidence readings of the path ending at node, from its replies' (None where its own reply
    has none): `mean` over all the path's tokens, `lowest_window` the path's least sure window (of any
    one reply), `tail` and `tail_margin` its last reply's."""
    last = tree[node].confidence
    if last is None:
        return None
    thoughts = [tree[n] for n in nx.shortest_path(tree.graph, tree.root, node)[1:]]
    path = [(t.tokens or 0, t.confidence) for t in thoughts if t.confidence]  # (tokens, readings) of each reply
    tokens = sum(n for n, _ in path)
    read = dict(last)
    if tokens:
        logprob = sum(n * math.log(max(c["mean"], 1e-300)) for n, c in path)
        read["mean"] = math.exp(logprob / tokens)
    read["lowest_window"] = min(c["lowest_window"] for _, c in path)
    return read


def confidence(reply: GenResult) -> float:
    """A reply's geometric-mean token probability (asked with GenRequest.logprobs); 1 for no tokens."""
    assert reply.logprobs is not None, "the reply was not asked for its log-probabilities"
    return mean_probability([t.logprob for t in reply.logprobs])


def split_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str]:
    """The text before the first of `stops` in it (what a request stopping there returns) and after it."""
    found = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    if not found:
        return text, ""
    i, stop = min(found)
    return text[:i], text[i + len(stop) :]


def finished_states(tree: ReasoningTree) -> list[int]:
    """Every state a path ended at (the depth limit, or where the task says it is complete), in
    node order: what BFS and MCTS vote over under search.aggregate=vote."""
    return [n for n in tree.graph.nodes if n != tree.root and tree[n].terminal]
