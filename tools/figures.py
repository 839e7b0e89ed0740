"""One set of benchmark figures for every page: docs/figures.toml holds the recorded runs, the pages quote them.

A page quotes a figure inside a span that this tool rewrites from the recorded runs, so no two pages can quote
different runs of a bench, and a figure outside its target is marked wherever it appears:

    <!-- figure simcheck.max_abs_error:t -->0.086 (target ≤ 0.10)<!-- /figure -->

    <!-- figures table=readme -->
    (the whole table, rows rendered from each bench's templates)
    <!-- /figures -->

A span in backticks is an example, left as it is. Commands (run from the repository root):

    python tools/figures.py record BENCH JSON [--commit C] [--date D] [--fresh] [--set KEY=VALUE ...]
    python tools/figures.py write
    python tools/figures.py check

`record` adds one run of BENCH, its keys read from the JSON that `hetdp bench BENCH --json JSON` wrote (`--fresh`
first drops the bench's earlier runs: the code changed); `write` rewrites every span; `check` exits 1 if a span
differs from what `write` would put there. Only the standard library: `make test` needs nothing new.

In a template (the bench's table texts in figures.toml), `{KEY}` is the key's range over the bench's runs, `{KEY:t}`
the same with its target, `{KEY:each}` one value per run, `{KEY:list}` a list-valued key element by element
(`{KEY:each+t}`, `{KEY:list+t}` with the target);
`{runs}`, `{commits}` and `{dates}` describe the runs. A span's name is `BENCH.KEY[:MODE]` in the same terms.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import math
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURES = Path("docs/figures.toml")
PAGES = ("README.md", "docs/**/*.md")
MARK = "✗"
NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
SPAN = re.compile(r"(?<!`)<!-- figure (?P<name>[\w.:+-]+) -->(?P<text>.*?)<!-- /figure -->", re.DOTALL)
TABLE = re.compile(r"(?<!`)<!-- figures table=(?P<name>[\w-]+) -->\n(?P<text>.*?)<!-- /figures -->", re.DOTALL)
FIELD = re.compile(r"\{(?P<key>[A-Za-z_]\w*)(?::(?P<mode>[\w+]+))?\}")
EXPONENT = re.compile(r"e([+-])0*(\d)")
TARGET = re.compile(r"^\s*(?P<op><=|>=)\s*(?P<number>\S+)\s*$")
MODES = ("", "each", "list")
NONE = "none"
"""How a missing value (JSON null) is stored: TOML has no null."""


class FiguresError(Exception):
    """A figure that cannot be rendered or recorded: the message names the bench and the key."""


@dataclass(frozen=True)
class Key:
    """One recorded figure of a bench: where `record` reads it and how the pages print it."""

    name: str
    json: str | None
    """Dotted path into the bench's JSON; `*` takes every element of a list or dict. None: `record --set` only."""
    fmt: str = ".3g"
    """Python format spec for each number (`.3f`, `+.1%`, `.1e`)."""
    scale: float = 1.0
    """Multiplies each number before formatting (1e-6 turns bytes into MB)."""
    suffix: str = ""
    """Printed after a number or a range (`x`, ` MB`)."""
    target: str | None = None
    """`<= 0.10` or `>= 0.95`: a value on the wrong side is marked wherever it appears."""
    none: str = "none"
    """Printed for a missing value (a run that never reached the figure)."""
    words: tuple[str, str] = ("no", "yes")
    """Printed for false and true."""

    @classmethod
    def parse(cls, name: str, spec: dict[str, Any]) -> Key:
        known = {"json", "fmt", "scale", "suffix", "target", "none", "words"}
        if unknown := set(spec) - known:
            raise FiguresError(f"key {name}: unknown fields {sorted(unknown)}, expected some of {sorted(known)}")
        if "target" in spec and not TARGET.match(spec["target"]):
            raise FiguresError(f"key {name}: target must read '<= N' or '>= N', got {spec['target']!r}")
        if "words" in spec:
            spec = {**spec, "words": tuple(spec["words"])}
        return cls(name=name, **spec)

    def number(self, value: float) -> str:
        """One number as the pages print it (`1.2e-7`, not `1.2e-07`)."""
        value = value * self.scale if self.scale != 1 else value
        if self.fmt.endswith("d"):
            value = round(value)
        return EXPONENT.sub(r"e\1\2", format(value, self.fmt)).replace("e+", "e")

    def outside(self, value: Any) -> bool:
        """Whether one value misses the target: a number on its wrong side, or a figure never reached."""
        if self.target is None or isinstance(value, bool):
            return False
        if value is None or value == NONE:
            return True
        if not _is_number(value):
            return False
        match = TARGET.match(self.target)
        assert match is not None  # checked in parse
        limit = float(match["number"])
        return value > limit if match["op"] == "<=" else value < limit

    def target_text(self) -> str:
        match = TARGET.match(self.target or "")
        if match is None:
            return ""
        # A percentage prints as its values do (+3.0%, not 0.03); any other limit as written (0.10, not 0.100).
        limit = self.number(float(match["number"])) if "%" in self.fmt else match["number"]
        return f"target {'≤' if match['op'] == '<=' else '≥'} {limit}"


@dataclass(frozen=True)
class Bench:
    """A bench's keys, its runs (each a dict with commit, date and the keys' values) and its page texts."""

    name: str
    keys: dict[str, Key]
    runs: list[dict[str, Any]]
    texts: dict[str, str]

    def render(self, template: str) -> str:
        """A template with every `{KEY[:MODE]}` and `{runs}`, `{commits}`, `{dates}` filled in from the runs."""
        return FIELD.sub(lambda match: self.field(match["key"], match["mode"] or ""), template)

    def field(self, name: str, mode: str = "") -> str:
        if name == "runs":
            count = len(self.runs)
            return f"{NUMBER_WORDS[count] if count < len(NUMBER_WORDS) else count} run{'s' if count != 1 else ''}"
        if name == "commits":
            return ", ".join(_unique(run["commit"] for run in self.runs))
        if name == "dates":
            return ", ".join(_unique(str(run["date"]) for run in self.runs))
        if name in self.texts:
            return self.render(self.texts[name])
        if name not in self.keys:
            raise FiguresError(f"bench {self.name} has no key {name!r}; its keys: {', '.join(sorted(self.keys))}")
        how, _, with_target = mode.partition("+") if mode != "t" else ("", "", "t")
        if how not in MODES or with_target not in ("", "t"):
            raise FiguresError(f"{self.name}.{name}: unknown mode {mode!r}, expected t, each, list, each+t or list+t")
        key = self.keys[name]
        runs = [run[name] for run in self.runs if name in run]
        if not runs:
            raise FiguresError(f"{self.name}.{name}: no run records it (record it with --set {name}=VALUE)")
        if how == "each":
            text = ", ".join(_range(key, list(_flatten([value]))) for value in runs)
        elif how == "list":
            text = _elementwise(key, runs)
        else:
            text = _range(key, list(_flatten(runs)))
        return text + _marker(key, runs, always=bool(with_target))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _flatten(values: Iterable[Any]) -> Iterable[Any]:
    for value in values:
        if isinstance(value, list):
            yield from _flatten(value)
        else:
            yield value


def _range(key: Key, values: Sequence[Any]) -> str:
    """The values as one figure: a number, `lo-hi` (`lo to hi` where a sign is printed), a word or a count."""
    numbers = [value for value in values if _is_number(value)]
    missing = sum(value is None or value == NONE for value in values)
    flags = [value for value in values if isinstance(value, bool)]
    if flags:
        if all(flags) or not any(flags):
            return key.words[flags[0]]
        return f"{key.words[True]} in {sum(flags)} of {len(flags)}"
    if not numbers:
        return key.none
    low, high = key.number(min(numbers)), key.number(max(numbers))
    if low == high:
        text = low + key.suffix
    else:
        joint = " to " if any(text[0] in "+-" or "e" in text for text in (low, high)) else "-"
        text = f"{low}{joint}{high}{key.suffix}"
    if missing:
        text += f" ({missing} {key.none})"
    return text


def _elementwise(key: Key, runs: Sequence[Any]) -> str:
    """A list-valued key, each element as its range over the runs."""
    lengths = {len(value) if isinstance(value, list) else -1 for value in runs}
    if len(lengths) != 1 or -1 in lengths:
        raise FiguresError(f"{key.name}: ':list' needs a list of the same length in every run")
    return ", ".join(_range(key, [value[index] for value in runs]) for index in range(lengths.pop()))


def _marker(key: Key, runs: Sequence[Any], *, always: bool) -> str:
    """` ✗ (target ≤ N; k of n runs outside)` where a value misses its target; the target alone under `:t`."""
    missed = sum(any(key.outside(value) for value in _flatten([run])) for run in runs)
    if missed:
        count = "" if len(runs) == 1 else "; every run" if missed == len(runs) else f"; {missed} of {len(runs)} runs"
        return f" {MARK} ({key.target_text()}{count})"
    return f" ({key.target_text()})" if always and key.target else ""


# --- the file of recorded runs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """docs/figures.toml: the benches and the page tables drawn from them."""

    benches: dict[str, Bench]
    tables: dict[str, dict[str, Any]]

    @classmethod
    def load(cls, path: Path) -> Figures:
        with path.open("rb") as file:
            data = tomllib.load(file)
        benches = {}
        for name, spec in data.get("bench", {}).items():
            spec = dict(spec)
            keys = {key: Key.parse(key, value) for key, value in spec.pop("keys", {}).items()}
            runs = spec.pop("runs", [])
            for run in runs:
                if "commit" not in run or "date" not in run:
                    raise FiguresError(f"bench {name}: every run needs a commit and a date, got {run!r}")
                if unknown := set(run) - set(keys) - {"commit", "date"}:
                    raise FiguresError(f"bench {name}: a run records {sorted(unknown)}, which are not its keys")
            benches[name] = Bench(name=name, keys=keys, runs=runs, texts=spec)
        return cls(benches=benches, tables=data.get("tables", {}))

    def span(self, name: str) -> str:
        """The text of `<!-- figure BENCH.KEY[:MODE] -->`."""
        bench, _, rest = name.partition(".")
        key, _, mode = rest.partition(":")
        if bench not in self.benches:
            raise FiguresError(f"figure {name}: no bench {bench!r} in {FIGURES}")
        return self.benches[bench].field(key, mode)

    def table(self, name: str) -> str:
        """The text of `<!-- figures table=NAME -->`: header, a row per bench, then any rows given as they are."""
        if name not in self.tables:
            raise FiguresError(f"table {name!r} is not in {FIGURES}; its tables: {', '.join(sorted(self.tables))}")
        spec = self.tables[name]
        if missing := [bench for bench in spec["benches"] if bench not in self.benches]:
            raise FiguresError(f"table {name} lists benches {missing} that {FIGURES} does not hold")
        rows = [self.benches[bench].render(spec["row"]) for bench in spec["benches"]]
        return "\n".join([*spec["header"], *rows, *spec.get("after", [])])


def rewrite(text: str, figures: Figures) -> str:
    """A page with every span filled in from the recorded runs."""
    text = TABLE.sub(lambda m: f"<!-- figures table={m['name']} -->\n\n{figures.table(m['name'])}\n\n"
                               "<!-- /figures -->", text)
    return SPAN.sub(lambda m: f"<!-- figure {m['name']} -->{figures.span(m['name'])}<!-- /figure -->", text)


def pages(root: Path) -> list[Path]:
    return sorted({page for pattern in PAGES for page in root.glob(pattern)})


def stale(root: Path) -> list[tuple[Path, str, str]]:
    """Every page whose spans differ from the recorded runs: (page, its text, the text `write` gives)."""
    figures = Figures.load(root / FIGURES)
    found = []
    for page in pages(root):
        text = page.read_text()
        try:
            wanted = rewrite(text, figures)
        except FiguresError as error:
            raise FiguresError(f"{page.relative_to(root)}: {error}") from error
        if wanted != text:
            found.append((page, text, wanted))
    return found


# --- recording a run ------------------------------------------------------------------------------------------


def extract(result: Any, path: str) -> Any:
    """The value at a dotted path of a bench's JSON; `*` takes every element (a list's or a dict's values)."""
    value = result
    parts = path.split(".")
    for index, part in enumerate(parts):
        if part == "*":
            items = value.values() if isinstance(value, dict) else value
            rest = ".".join(parts[index + 1:])
            return [extract(item, rest) if rest else item for item in items]
        if isinstance(value, list):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise FiguresError(f"the JSON has nothing at {path!r} (stopped at {part!r})")
    return value


def toml_value(value: Any) -> str:
    """A value as TOML writes it (None as the string "none": TOML has no null)."""
    if value is None:
        return json.dumps(NONE)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FiguresError(f"cannot record {value!r}")
        return repr(value)
    if isinstance(value, int | str):
        return json.dumps(value)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise FiguresError(f"cannot record {value!r} ({type(value).__name__})")


def record(path: Path, bench: str, result: dict[str, Any], *, commit: str, date: str, fresh: bool = False,
           extra: dict[str, Any] | None = None) -> str:
    """Add one run of `bench` to the file at `path` (its earlier runs dropped first if `fresh`); the run's text."""
    figures = Figures.load(path)
    if bench not in figures.benches:
        raise FiguresError(f"no bench {bench!r} in {path}; its benches: {', '.join(sorted(figures.benches))}")
    keys = figures.benches[bench].keys
    values: dict[str, Any] = {}
    for name, key in keys.items():
        if key.json is not None:
            values[name] = extract(result, key.json)
    for name, value in (extra or {}).items():
        if name not in keys:
            raise FiguresError(f"--set {name}: bench {bench} has no such key; its keys: {', '.join(sorted(keys))}")
        values[name] = value
    block = "\n".join([f"[[bench.{bench}.runs]]", f"commit = {json.dumps(commit)}", f"date = {json.dumps(date)}",
                       *(f"{name} = {toml_value(value)}" for name, value in values.items())])
    path.write_text(_insert(path.read_text(), bench, block, fresh=fresh))
    Figures.load(path)  # the file still reads
    return block


def _insert(text: str, bench: str, block: str, *, fresh: bool) -> str:
    """The file's text with `block` after the bench's last section; with `fresh`, without its earlier runs.

    A section is a header and its lines; the comments and blank lines just above a header belong to it.
    """
    sections: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.startswith("["):
            lead: list[str] = []
            while sections[-1] and (not sections[-1][-1].strip() or sections[-1][-1].startswith("#")):
                lead.insert(0, sections[-1].pop())
            sections.append(lead)
        sections[-1].append(line)

    def header(section: list[str]) -> str:
        return next((line for line in section if line.startswith("[")), "")

    own = re.compile(rf"^\[\[?bench\.{re.escape(bench)}(\]|\.)")
    runs = f"[[bench.{bench}.runs]]"
    last = max(index for index, section in enumerate(sections) if own.match(header(section)))
    out: list[str] = []
    for index, section in enumerate(sections):
        if not (fresh and header(section) == runs):
            out.extend(section)
        if index == last:
            while out and not out[-1].strip():
                out.pop()
            out.extend(["", block])
    return "\n".join(out).rstrip("\n") + "\n"


def _parse_set(item: str) -> tuple[str, Any]:
    name, sep, raw = item.partition("=")
    if not sep:
        raise FiguresError(f"--set wants KEY=VALUE, got {item!r}")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def _git_commit(root: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(prog="tools/figures.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("record", help="add a run of BENCH from the JSON its --json wrote")
    add.add_argument("bench")
    add.add_argument("json", type=Path)
    add.add_argument("--commit", help="the code that measured it (default: HEAD)")
    add.add_argument("--date", help="YYYY-MM-DD (default: today, UTC)")
    add.add_argument("--fresh", action="store_true", help="drop the bench's earlier runs first (the code changed)")
    add.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a key the JSON lacks")
    commands.add_parser("write", help="rewrite every figure span of the pages from the recorded runs")
    commands.add_parser("check", help="exit 1 if a span differs from the recorded runs")
    args = parser.parse_args(argv)
    try:
        if args.command == "record":
            block = record(root / FIGURES, args.bench, json.loads(args.json.read_text()),
                           commit=args.commit or _git_commit(root),
                           date=args.date or datetime.datetime.now(datetime.UTC).date().isoformat(),
                           fresh=args.fresh, extra=dict(_parse_set(item) for item in args.set))
            print(f"{FIGURES}: recorded\n{block}\nnow run: python tools/figures.py write")
        elif args.command == "write":
            for page, _, wanted in stale(root):
                page.write_text(wanted)
                print(f"rewrote {page.relative_to(root)}")
        else:
            found = stale(root)
            for page, text, wanted in found:
                name = str(page.relative_to(root))
                sys.stdout.writelines(difflib.unified_diff(text.splitlines(keepends=True),
                                                           wanted.splitlines(keepends=True),
                                                           f"{name} (the page)", f"{name} (from {FIGURES})", n=0))
            if found:
                print("run: python tools/figures.py write")
                return 1
    except FiguresError as error:
        print(f"tools/figures.py: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
