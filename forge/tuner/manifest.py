"""The tuning manifest (`forge.toml`): many (op, shape, dtype) entries tuned by one command.

Format (docs/manifest.md, forge.toml.example):

    [defaults]                 # optional; run-wide settings and per-entry defaults
    device = "cuda"            # cuda | cpu
    dtype = "bfloat16"
    budget = 50
    strategy = "evolve"        # evolve (default) | grid | random | halving
    seed = 0
    timeout = 120              # seconds per candidate
    workers = 8
    cache = "tuning/forge.db"  # relative to the manifest's directory
    time_budget = 3600         # seconds of wall clock for the whole run (run-wide)

    [[op]]
    op = "rmsnorm"
    shapes = ["2048x4096", "8192x8192"]   # or shape = "2048x4096"; [2048, 4096] lists work too
    dtypes = ["float16", "bfloat16"]      # or dtype = "float16"
    budget = 80                           # per-entry: dtype(s), budget, strategy, seed, timeout
    eps = 1e-6                            # any other key is one of the op's attributes
    share = 0.31                          # fraction of the model's time (forge trace --profile writes it)

Precedence, per setting, first found wins: command-line option > environment variable (FORGE_DEVICE,
FORGE_DTYPE, FORGE_BUDGET, FORGE_STRATEGY, FORGE_SEED, FORGE_TIMEOUT, FORGE_WORKERS, FORGE_TIME_BUDGET;
the cache: FORGE_CACHE_DIR) > the entry's own value > the manifest's [defaults] > forge's built-in default.

`share` (0..1) is the fraction of the profiled model time the entry's op took; an entry that expands
to several jobs (shapes x dtypes) splits it evenly among them (Job.share). The entries' shares add up
to at most 1. `forge search --manifest` tunes jobs by share, largest first, and estimates the model's
end-to-end speedup from them (batch.estimated_speedup).

Every error names the file, the entry and the field, and is a UsageError (exit code 2).
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge import key as keys
from forge import opkit
from forge.errors import UsageError, cut, shown
from forge.spec import DTYPES, canonical_json, parse_shape
from forge.tuner import strategy

BUILTIN = {"device": None, "dtype": "float16", "budget": 50, "strategy": strategy.DEFAULT, "seed": 0, "timeout": 120.0,
           "workers": None, "time_budget": None, "effort": "default"}
ENV = {"device": "FORGE_DEVICE", "dtype": "FORGE_DTYPE", "budget": "FORGE_BUDGET", "strategy": "FORGE_STRATEGY",
       "seed": "FORGE_SEED", "timeout": "FORGE_TIMEOUT", "workers": "FORGE_WORKERS",
       "time_budget": "FORGE_TIME_BUDGET", "effort": "FORGE_EFFORT"}
# Effort presets (as Helion's none/quick/full): the candidate budget a search gets where no layer names a
# budget (an explicit budget, at any precedence, wins). quick: a dozen candidates (grid still sees every
# variant); default: 50 (grid's measured quality on the H200: 1.000 on the norm/CE/GELU spaces of 56-127
# points, 0.985 on sdpa's 180, 0.925 on matmul's 748); full: every valid point (exhaustive).
EFFORT_BUDGET = {"quick": 12, "default": 50, "full": 10**9}
# One pool, one cache and one wall-clock budget per run: [defaults] only.
RUN_WIDE = ("device", "workers", "cache", "time_budget")
PER_ENTRY = ("dtype", "budget", "strategy", "seed", "timeout", "effort")
ENTRY_FIELDS = ("op", "shape", "shapes", "dtypes", "share", *PER_ENTRY)
# The entries' shares may add up to a little over 1 from rounding (forge trace writes 6 digits).
SHARE_SUM_SLACK = 1e-3


class ManifestError(UsageError):
    """A manifest that cannot be used; the message names the file, entry and field."""


@dataclass(frozen=True)
class Job:
    """One (op, shape, dtype, attrs) to tune, with its resolved search settings."""

    op: str
    shape: tuple[int, ...]
    dtype: str
    attrs: dict[str, Any]
    budget: int
    strategy: str
    seed: int
    timeout: float
    entry: int  # 1-based [[op]] index in the manifest, for messages
    # This job's part of the profiled model time (0..1): its entry's `share` split evenly over the
    # entry's jobs; None when the entry gives no share.
    share: float | None = None

    @property
    def label(self) -> str:
        attrs = " ".join(f"{k}={v}" for k, v in sorted(self.attrs.items()))
        return f"{self.op} {'x'.join(map(str, self.shape))} {self.dtype}" + (f" {attrs}" if attrs else "")

    @property
    def identity(self) -> str:
        """What makes two jobs the same work (settings like budget do not)."""
        return canonical_json({"op": self.op, "shape": list(self.shape), "dtype": self.dtype, "attrs": self.attrs})


@dataclass
class Manifest:
    path: Path
    jobs: list[Job]
    device: str | None = None
    workers: int | None = None
    cache: Path | None = None
    raw_defaults: dict[str, Any] = field(default_factory=dict)
    time_budget: float | None = None  # seconds of wall clock for the whole run; None: no limit


# -- value checks (one per setting) ----------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_setting(name: str, v: Any, where: str | None) -> Any:
    """v if it is a valid value of setting `name`, else ManifestError; where=None: a command-line option."""
    enumerated = name in ("device", "dtype", "strategy", "effort")

    def bad(expected: str) -> ManifestError:
        what = (f"unknown {name} {shown(v)}; expected {expected}" if enumerated
                else f"expected {expected}, got {shown(v)}")
        flag = "--" + name.replace("_", "-")
        return ManifestError(f"{flag}: {what}" if where is None else f"{where}: field '{name}': {what}")

    if name == "device":
        if v not in ("cuda", "cpu"):
            raise bad("'cuda' or 'cpu'")
    elif name == "dtype":
        if v not in DTYPES:
            raise bad(f"one of {', '.join(DTYPES)}")
    elif name == "strategy":
        if v not in strategy.names():
            raise bad(" or ".join(f"'{n}'" for n in strategy.names()))
    elif name == "effort":
        if v not in EFFORT_BUDGET:
            raise bad(" or ".join(f"'{n}'" for n in EFFORT_BUDGET))
    elif name in ("budget", "workers"):
        if not _is_int(v) or v < 1:
            raise bad("an integer >= 1")
    elif name == "seed":
        if not _is_int(v) or v < 0:
            raise bad("an integer >= 0")
    elif name == "timeout":
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or v == float("inf"):
            raise bad("a positive number of seconds")
        v = float(v)
    elif name == "time_budget":
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 or v == float("inf"):
            raise bad("a number of seconds >= 0")
        v = float(v)
    elif name == "share":
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
            raise bad("a fraction of the model's time, a number from 0 to 1")
        v = float(v)
    elif name == "cache":
        if not isinstance(v, str) or not v:
            raise bad("a path string")
    return v


def _from_env(name: str, env: Mapping[str, str]) -> Any:
    var = ENV[name]
    raw = env.get(var)
    if raw is None or raw == "":  # an empty variable counts as unset (shell convention)
        return None
    value: Any = raw
    if name in ("budget", "workers", "seed"):
        try:
            value = int(raw)
        except ValueError:
            raise UsageError(f"environment variable {var}={raw!r}: expected an integer") from None
    elif name in ("timeout", "time_budget"):
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"environment variable {var}={raw!r}: expected a number") from None
    try:
        return check_setting(name, value, f"environment variable {var}")
    except ManifestError as exc:
        raise UsageError(str(exc)) from None


def resolve(name: str, cli: Mapping[str, Any], env: Mapping[str, str], *layers: Mapping[str, Any]) -> Any:
    """The value of one setting: CLI > environment > layers in order (entry, [defaults]) > built-in; the
    budget's built-in is the resolved effort's (EFFORT_BUDGET)."""
    if cli.get(name) is not None:
        return cli[name]
    if (v := _from_env(name, env)) is not None:
        return v
    for layer in layers:
        if layer.get(name) is not None:
            return layer[name]
    if name == "budget":
        return EFFORT_BUDGET[resolve("effort", cli, env, *layers)]
    return BUILTIN[name]


# -- loading ---------------------------------------------------------------------------------------
def _shapes(entry: dict, where: str) -> list[tuple[int, ...]]:
    if ("shape" in entry) == ("shapes" in entry):
        raise ManifestError(f"{where}: give exactly one of 'shape' or 'shapes'")
    raw = [entry["shape"]] if "shape" in entry else entry["shapes"]
    fld = "shape" if "shape" in entry else "shapes"
    if not isinstance(raw, list) or not raw:
        raise ManifestError(f"{where}: field '{fld}': expected a non-empty list of shapes, got {shown(raw)}")
    out = []
    for s in raw:
        if isinstance(s, str):
            try:
                out.append(parse_shape(s))
            except ValueError as exc:
                raise ManifestError(f"{where}: field '{fld}': {exc}") from None
        elif isinstance(s, list) and s and all(_is_int(d) and d >= 1 for d in s):
            out.append(tuple(s))
        else:
            raise ManifestError(f"{where}: field '{fld}': {shown(s)} is not a shape like \"2048x4096\" or [2048, 4096]")
    return out


def _dtypes(entry: dict, where: str) -> list[str | None]:
    if "dtype" in entry and "dtypes" in entry:
        raise ManifestError(f"{where}: give at most one of 'dtype' or 'dtypes'")
    if "dtypes" in entry:
        raw = entry["dtypes"]
        if not isinstance(raw, list) or not raw:
            raise ManifestError(f"{where}: field 'dtypes': expected a non-empty list, got {shown(raw)}")
        return [check_setting("dtype", d, where) for d in raw]
    if "dtype" in entry:
        return [check_setting("dtype", entry["dtype"], where)]
    return [None]  # resolved later (environment, [defaults], built-in)


def load(path: str | os.PathLike, *, cli: Mapping[str, Any] | None = None,
         env: Mapping[str, str] | None = None) -> Manifest:
    """Parse and validate a manifest, expand its entries into jobs and resolve every setting."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: invalid TOML: {exc}") from None
    return parse(doc, path, cli=cli, env=env)


def parse(doc: dict[str, Any], path: str | os.PathLike, *, cli: Mapping[str, Any] | None = None,
          env: Mapping[str, str] | None = None) -> Manifest:
    """A manifest from its parsed document ({"defaults": {...}, "op": [{...}, ...]}, what TOML gives);
    `path` names it in messages and anchors a relative cache path. forge trace DIR/ builds its jobs here
    from the entries it found, with the same checks and precedence as a file."""
    from forge import ops

    cli = dict(cli or {})
    env = os.environ if env is None else env
    path = Path(path)
    unknown = sorted(set(doc) - {"defaults", "op"})
    if unknown:
        raise ManifestError(f"{path}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
                            "expected [defaults] and [[op]] entries")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ManifestError(f"{path}: 'defaults' must be a table ([defaults])")
    where_d = f"{path}: [defaults]"
    if "share" in defaults:
        raise ManifestError(f"{where_d}: field 'share' belongs to an [[op]] entry (the fraction of the model's "
                            "time that entry's op took)")
    bad = sorted(set(defaults) - set(BUILTIN) - {"cache"})
    if bad:
        raise ManifestError(f"{where_d}: unknown field(s) {', '.join(shown(b, 40) for b in bad[:10])}; known: "
                            f"{', '.join(sorted([*BUILTIN, 'cache']))}")
    defaults = {k: check_setting(k, v, where_d) for k, v in defaults.items()}
    entries = doc.get("op", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ManifestError(f"{path}: 'op' must be an array of tables ([[op]] entries)")
    if not entries:
        raise ManifestError(f"{path}: no [[op]] entries")
    known_ops = ops.available()
    families: dict[str, ops.OpFamily] = {}  # loaded once per op, not once per entry (manifests of 10^5 entries)
    jobs: list[Job] = []
    seen: dict[str, Job] = {}
    share_sum = 0.0
    for i, entry in enumerate(entries, 1):
        name = entry.get("op")
        where = f"{path}: [[op]] #{i}" + (f" ({cut(name, 40)})" if isinstance(name, str) else "")
        if not isinstance(name, str):
            raise ManifestError(f"{where}: field 'op': expected an op name, got {shown(name)}")
        if name not in known_ops:
            raise ManifestError(f"{where}: field 'op': unknown op {shown(name)}; known ops: "
                                f"{', '.join(sorted(known_ops))}")
        if name not in families:
            families[name] = ops.get(name)
        opmod = families[name].module
        for k in RUN_WIDE:
            if k in entry:
                raise ManifestError(f"{where}: field '{k}' is run-wide: set it in [defaults] or on the command line")
        # "strides" (an input layout, forge/opkit.py) is forge's attribute: the op's make_spec says whether it
        # takes that layout.
        attr_names = set(opmod.DEFAULT_ATTRS) | set(getattr(opmod, "OPTIONAL_ATTRS", ())) | {opkit.STRIDES}
        unknown = sorted(set(entry) - set(ENTRY_FIELDS) - attr_names)
        if unknown:
            raise ManifestError(f"{where}: unknown field(s) {', '.join(shown(u, 40) for u in unknown[:10])}; "
                                f"entry fields: "
                                f"{', '.join(ENTRY_FIELDS)}; {name} attributes: "
                                f"{', '.join(sorted(attr_names)) or '(none)'}")
        attrs = {}
        for k in sorted(attr_names & set(entry)):
            v = entry[k]
            if not isinstance(v, bool | int | float | str):
                raise ManifestError(f"{where}: field '{k}': an attribute must be a number, bool or string, "
                                    f"got {shown(v)}")
            try:
                keys.check_attrs({k: v})
            except ValueError as exc:
                raise ManifestError(f"{where}: field '{k}': {exc}") from None
            attrs[k] = v
        own = {k: check_setting(k, entry[k], where) for k in PER_ENTRY if k in entry and k != "dtype"}
        share = check_setting("share", entry["share"], where) if "share" in entry else None
        # An override (--dtype, FORGE_DTYPE) replaces the entry's dtype list by that one dtype.
        dtypes = list(dict.fromkeys(resolve("dtype", cli, env, {"dtype": dt}, defaults)
                                    for dt in _dtypes(entry, where)))
        shapes = _shapes(entry, where)
        if share is not None:
            share_sum += share
            share /= len(shapes) * len(dtypes)  # split evenly over the entry's jobs
        for shape in shapes:
            for dtype in dtypes:
                try:
                    spec = opmod.make_spec(shape, dtype, "cpu", attrs)
                except (ValueError, TypeError, OverflowError) as exc:
                    raise ManifestError(f"{where}: shape {cut('x'.join(map(str, shape)), 60)} {dtype}: "
                                        f"{cut(str(exc), 300)}") from None
                job = Job(op=name, shape=tuple(shape), dtype=dtype, attrs=dict(spec.attrs),
                          budget=resolve("budget", cli, env, own, defaults),
                          strategy=resolve("strategy", cli, env, own, defaults),
                          seed=resolve("seed", cli, env, own, defaults),
                          timeout=resolve("timeout", cli, env, own, defaults), entry=i, share=share)
                if job.identity in seen:
                    first = seen[job.identity]
                    raise ManifestError(f"{where}: duplicate of [[op]] #{first.entry}: {job.label} is listed twice")
                seen[job.identity] = job
                jobs.append(job)
    if share_sum > 1.0 + SHARE_SUM_SLACK:
        raise ManifestError(f"{path}: field 'share': the entries' shares add up to {share_sum:.4g}, more than 1 "
                            "(each is a fraction of the same model's time)")
    cache = None
    if cli.get("cache") is not None:
        cache = Path(cli["cache"])
    elif env.get("FORGE_CACHE_DIR"):
        cache = None  # default_cache_path() reads FORGE_CACHE_DIR
    elif "cache" in defaults:
        cache = Path(os.path.expanduser(defaults["cache"]))
        if not cache.is_absolute():
            cache = path.parent / cache
    return Manifest(path=path, jobs=jobs, device=resolve("device", cli, env, defaults),
                    workers=resolve("workers", cli, env, defaults), cache=cache, raw_defaults=defaults,
                    time_budget=resolve("time_budget", cli, env, defaults))


# -- sharding --------------------------------------------------------------------------------------
def parse_shard(text: str) -> tuple[int, int]:
    """'i/N' with 0 <= i < N (a Slurm array with --array=0-(N-1) passes $SLURM_ARRAY_TASK_ID/N)."""
    i, sep, n = text.partition("/")
    if not sep or not i.strip().isdigit() or not n.strip().isdigit():
        raise UsageError(f"--shard expects I/N with 0 <= I < N (e.g. 0/4), got {text!r}")
    i_, n_ = int(i), int(n)
    if n_ < 1 or not 0 <= i_ < n_:
        raise UsageError(f"--shard {text}: need N >= 1 and 0 <= I < N")
    return i_, n_


def shard(jobs: list[Job], i: int, n: int) -> list[Job]:
    """Shard i of n: jobs are ordered by a hash of their identity (independent of the manifest's
    order, so reordering entries moves nothing) and dealt round-robin (sizes differ by at most one)."""
    order = sorted(jobs, key=lambda j: hashlib.sha256(j.identity.encode()).hexdigest())
    return [j for k, j in enumerate(order) if k % n == i]


# -- writing (forge trace --write-manifest) --------------------------------------------------------
def dumps(entries: list[dict[str, Any]], defaults: dict[str, Any] | None = None) -> str:
    """A manifest from [{"op", "shapes": ["MxN"...], "dtype", **attrs}, ...] (tomli-w)."""
    import tomli_w

    doc: dict[str, Any] = {}
    if defaults:
        doc["defaults"] = defaults
    doc["op"] = entries
    return tomli_w.dumps(doc)
