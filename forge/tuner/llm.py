"""LLM-proposed candidates over rounds (issue 17; the original design's `optimize_rounds`).

Proposals are structured parameters of the op's space, never code: each round forge hands the proposer one
JSON document and reads back candidates, each validated against the space (a variant it has, exactly its
parameters, allowed values, the space's validity rule, not tried before). An invalid proposal is rejected
with its reason and does not count against the budget. The proposer is pluggable:

- `CommandClient(cmd)`: any program (`forge search --strategy llm --llm-command CMD`, other providers, offline
  runs). Protocol: forge writes one JSON document to its stdin,
      {"op", "spec", "space": {"variants": {VARIANT: {PARAM: [allowed values]}}},
       "history": [{"variant", "params", "status", "p50_us"}], "n", "round", "rounds", "hardware"}
  and reads one from its stdout: {"candidates": [{"variant", "params": {...}}], "usage": {"input_tokens": N,
  "output_tokens": M}}. A command that fails, times out or prints invalid JSON is a recorded failure of
  that round, not of the search.
- `FunctionClient(fn)`: `propose_fn(doc) -> dict` in Python, the same documents.
- `AnthropicClient(model)`: the Anthropic SDK (`pip install 'forge-kernel[llm]'`), the key from
  ANTHROPIC_API_KEY (missing: an EnvironmentProblem, exit 3, saying what to do); FORGE_LLM_MODEL picks the
  model.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from forge.errors import EnvironmentProblem, UsageError
from forge.opkit import Candidate, Space
from forge.tuner import strategy as strategies

DEFAULT_MODEL = "claude-sonnet-4-5"
COMMAND_TIMEOUT_S = 120.0


class RoundFailed(Exception):
    """The proposer could not answer this round (the search goes on with the next)."""


def space_doc(space: Space) -> dict[str, Any]:
    return {"variants": {v: {k: list(vals) for k, vals in grid.items()} for v, grid in space.variants.items()}}


def history_doc(history: Mapping[Candidate, Any]) -> list[dict[str, Any]]:
    out = []
    for c, o in history.items():
        t = strategies.score(o)
        status = "ok" if t is not None else str(getattr(o, "status", None) or "failed")  # StrEnum: its value
        out.append({"variant": c.variant, "params": c.p, "status": status,
                    "p50_us": round(t, 3) if t is not None else None})
    return out


class CommandClient:
    def __init__(self, cmd: str, timeout: float = COMMAND_TIMEOUT_S):
        self.argv = shlex.split(cmd)
        if not self.argv:
            raise UsageError("--llm-command: an empty command")
        self.timeout = timeout

    def __call__(self, doc: dict[str, Any]) -> dict[str, Any]:
        try:
            res = subprocess.run(self.argv, input=json.dumps(doc), capture_output=True, text=True,
                                 timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise RoundFailed(f"the command timed out after {self.timeout:.0f} s") from None
        except OSError as exc:
            raise RoundFailed(f"the command could not run: {exc}") from None
        if res.returncode != 0:
            raise RoundFailed(f"the command exited {res.returncode}: {res.stderr.strip()[:200]}")
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError as exc:
            raise RoundFailed(f"the command printed no JSON document ({exc})") from None


class FunctionClient:
    def __init__(self, fn: Callable[[dict[str, Any]], dict[str, Any]]):
        self.fn = fn

    def __call__(self, doc: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.fn(doc)
        except Exception as exc:  # noqa: BLE001 - the user's proposer: its failure is the round's
            raise RoundFailed(f"propose_fn raised {type(exc).__name__}: {exc}") from None


PROMPT = """You tune a Triton GPU kernel. Propose {n} new candidates from the search space below, as JSON only:
{{"candidates": [{{"variant": "...", "params": {{...}}}}]}}. Each candidate names one variant and gives every one
of its parameters a value from its allowed list. Do not repeat a candidate from the history (lower p50_us is
better; failed ones did not compile, validate or time). Use what the history shows.

{doc}"""


class AnthropicClient:
    def __init__(self, model: str | None = None, api_key: str | None = None, max_tokens: int = 2048):
        key = api_key or os.environ.get("ANTHROPIC_API_KEY")
        if not key:
            raise EnvironmentProblem("--strategy llm: ANTHROPIC_API_KEY is not set; set it, or give "
                                     "--llm-command CMD (any program speaking forge's JSON protocol, docs/search.md)")
        try:
            import anthropic
        except ImportError:
            raise EnvironmentProblem("--strategy llm: the Anthropic SDK is not installed: pip install "
                                     "'forge-kernel[llm]' (or give --llm-command CMD)") from None
        self.client = anthropic.Anthropic(api_key=key)
        self.model = model or os.environ.get("FORGE_LLM_MODEL") or DEFAULT_MODEL
        self.max_tokens = max_tokens

    def __call__(self, doc: dict[str, Any]) -> dict[str, Any]:
        try:
            msg = self.client.messages.create(model=self.model, max_tokens=self.max_tokens, messages=[
                {"role": "user", "content": PROMPT.format(n=doc["n"], doc=json.dumps(doc))}])
        except Exception as exc:  # noqa: BLE001 - network, quota, API errors: this round fails
            raise RoundFailed(f"the Anthropic API failed: {type(exc).__name__}: {exc}") from None
        text = "".join(getattr(b, "text", "") for b in msg.content)
        start, end = text.find("{"), text.rfind("}")
        try:
            answer = json.loads(text[start:end + 1]) if start >= 0 else None
        except json.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise RoundFailed("the model's answer held no JSON object")
        usage = getattr(msg, "usage", None)
        answer["usage"] = {"input_tokens": getattr(usage, "input_tokens", 0),
                           "output_tokens": getattr(usage, "output_tokens", 0)}
        return answer


def validate(space: Space, proposal: Any, seen: set[Candidate]) -> tuple[Candidate | None, str | None]:
    """(the candidate, None) for a valid new proposal, else (None, why it was rejected)."""
    if not isinstance(proposal, dict) or not isinstance(proposal.get("params"), dict):
        return None, "not an object with 'variant' and 'params'"
    variant = proposal.get("variant")
    grid = space.variants.get(variant) if isinstance(variant, str) else None
    if grid is None:
        return None, f"unknown variant {variant!r} (the space has {', '.join(space.variants)})"
    params = proposal["params"]
    if set(params) != set(grid):
        return None, f"{variant} takes exactly {sorted(grid)}, got {sorted(params)}"
    for k, v in params.items():
        if isinstance(v, bool) or v not in grid[k]:
            return None, f"{variant}: {k}={v!r} is not one of {grid[k]}"
    cand = Candidate.make(variant, **params)
    if not space.valid(cand):
        return None, f"{cand.label} breaks the space's validity rule (registers, shared memory, tile limits)"
    if cand in seen:
        return None, f"{cand.label} was tried already"
    return cand, None


@dataclass
class LLMStrategy:
    """A search strategy whose candidates an LLM (or any proposer) chooses, round by round."""

    client: Callable[[dict[str, Any]], dict[str, Any]]
    op: str
    spec: dict[str, Any]
    rounds: int
    per_round: int
    hardware: dict[str, Any] = field(default_factory=dict)
    first: Candidate | None = None
    round: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    rejected: list[tuple[int, Any, str]] = field(default_factory=list)  # (round, proposal, why)
    failures: list[tuple[int, str]] = field(default_factory=list)  # (round, why)
    seconds: float = 0.0  # wall time in the proposer
    tokens_of: dict[Candidate, int] = field(default_factory=dict)  # each accepted candidate's share of its round

    def propose(self, space: Space, history: Mapping[Candidate, Any], n: int) -> list[Candidate]:
        if n <= 0:
            return []
        if self.first is not None and self.first not in history:  # the op's default: tried first, as always
            return [self.first]
        while self.round < self.rounds:
            self.round += 1
            want = min(n, self.per_round)
            doc = {"op": self.op, "spec": self.spec, "space": space_doc(space), "history": history_doc(history),
                   "n": want, "round": self.round, "rounds": self.rounds, "hardware": self.hardware}
            t0 = time.monotonic()
            try:
                answer = self.client(doc)
            except RoundFailed as exc:
                self.failures.append((self.round, str(exc)))
                continue
            finally:
                self.seconds += time.monotonic() - t0
            usage = answer.get("usage") if isinstance(answer, dict) else None
            spent = 0
            if isinstance(usage, dict):
                spent = int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)
                self.input_tokens += int(usage.get("input_tokens") or 0)
                self.output_tokens += int(usage.get("output_tokens") or 0)
            proposals = answer.get("candidates") if isinstance(answer, dict) else None
            if not isinstance(proposals, list):
                self.failures.append((self.round, "the answer has no 'candidates' list"))
                continue
            out: list[Candidate] = []
            seen = set(history)
            for p in proposals:
                cand, why = validate(space, p, seen | set(out))
                if cand is None:
                    self.rejected.append((self.round, p, why))
                elif len(out) < want:
                    out.append(cand)
            if out:
                for c in out:
                    self.tokens_of[c] = spent // len(out)
                return out
        return []

    def usage(self) -> dict[str, Any]:
        return {"rounds": self.round, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "proposer_seconds": round(self.seconds, 3),
                "rejected": [{"round": r, "proposal": p, "reason": why} for r, p, why in self.rejected],
                "failed_rounds": [{"round": r, "reason": why} for r, why in self.failures]}


def make_client(command: str | None = None, propose_fn: Callable | None = None, model: str | None = None):
    """The proposer: propose_fn (Python), else a command, else the Anthropic SDK."""
    if propose_fn is not None:
        return FunctionClient(propose_fn)
    if command:
        return CommandClient(command)
    return AnthropicClient(model)


def optimize_rounds(spec, llm, n_rounds: int, candidates_per_round: int, *, device: str | None = None,
                    cache=None, force: bool = False) -> dict[str, Any]:
    """The original design's entry point: search `spec` (a forge.KernelSpec, or (op, shape, dtype[, attrs]))
    with `llm` proposing `candidates_per_round` candidates in each of `n_rounds` rounds. `llm` is a client
    (make_client(...)) or a propose_fn. Returns {"best": {"variant", "params", "p50_us"} or None, "decision",
    "speedup", "usage": {...tokens, rounds, rejected, failed rounds...}, "benchmark_seconds", "report"}."""
    from forge.spec import KernelSpec
    from forge.tuner import api, engine

    client = llm if isinstance(llm, (CommandClient, FunctionClient, AnthropicClient)) else FunctionClient(llm)
    if isinstance(spec, KernelSpec):
        op, shape, dtype, attrs, device = api._from_spec(spec, device)
    else:
        op, shape, dtype, *rest = spec
        attrs = dict(rest[0]) if rest else {}
    db, own = api._open(cache)
    try:
        options = engine.SearchOptions(budget=n_rounds * candidates_per_round + 1, strategy="llm", llm=client,
                                       rounds=n_rounds, per_round=candidates_per_round, force=force)
        report = engine.search(op, tuple(shape), dtype, device=device, cache=db, attrs=attrs, options=options)
    finally:
        if own:
            db.close()
    best = None
    timed = [(strategies.score_dict(c), c) for c in report.candidates if c.get("variant") != "torch"]
    timed = [(t, c) for t, c in timed if t is not None]
    if timed:
        t, c = min(timed, key=lambda tc: tc[0])
        best = {"variant": c["variant"], "params": c["params"], "p50_us": t}
    return {"best": best, "decision": report.decision, "speedup": report.speedup, "usage": report.llm,
            "benchmark_seconds": round(report.seconds - (report.llm or {}).get("proposer_seconds", 0.0), 3),
            "report": report}
