"""The documentation, checked: the README's size, the two generated pages, every documented
``specforge`` and ``torchrun`` command line parsed by the real command line, the end-to-end
"your model" example run on a tiny stand-in target, and no wording about how the project was
made."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specforge.cli import parse_args, stage_config
from specforge.config import ConfigError, load_config, recipe_path
from specforge.docgen import main as docgen_main
from specforge.docgen import pages
from specforge.errors import UserError
from specforge.results import PROVENANCE_KEYS, load_results, write_result
from tests.helpers import REPO, VLLM_PIN, sglang_loopback
from tests.serving.test_vllm_client import vllm_rows

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RECIPES = sorted((REPO / "specforge" / "configs").glob("*.yaml"))
PLACEHOLDERS = {"NODE_RANK": "0", "MASTER": "127.0.0.1"}
"""Shell variables the documented commands use, with a value to parse them by."""
SCRIPT_STAGES = {
    "train_eagle3.py": "train",
    "capture_hidden_states.py": "capture",
    "prepare_data.py": "prepare",
    "export_draft.py": "export",
    "bench_accept_length.py": "bench",
}
"""``scripts/`` entry points and the subcommand each runs."""


def test_readme_is_a_short_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    for page in ("quickstart", "concepts", "data", "training", "distributed"):
        assert f"docs/{page}.md" in "\n".join(lines)
    for page in ("export-and-serving", "bench-and-runtime", "architectures", "configuration"):
        assert (REPO / "docs" / f"{page}.md").is_file()
    for page in ("benchmarks", "troubleshooting", "results"):
        assert (REPO / "docs" / f"{page}.md").is_file()


def test_generated_pages_are_current():
    for path, text in pages().items():
        assert path.read_text() == text, f"{path} is stale: run python -m specforge.docgen"


def test_the_staleness_check_bites(tmp_path, capsys):
    """A results file whose figure changed makes ``--check`` fail, naming the results page;
    without ``--check`` the page is rewritten and the check passes again."""
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    assert docgen_main(["--check", "--docs", str(docs)]) == 0
    path = docs / "results" / "quickstart_cpu.json"
    record = json.loads(path.read_text())
    record["figures"]["eval tau_pred"] = 9.99
    path.write_text(json.dumps(record))
    assert docgen_main(["--check", "--docs", str(docs)]) == 1
    assert "results.md is stale" in capsys.readouterr().err
    assert docgen_main(["--docs", str(docs)]) == 0
    assert "| eval tau_pred | 9.99 |" in (docs / "results.md").read_text()
    assert docgen_main(["--check", "--docs", str(docs)]) == 0


def test_every_results_file_says_where_it_was_measured():
    records = load_results(REPO / "docs" / "results")
    assert records
    for stem, record in records:
        assert all(record[key] for key in PROVENANCE_KEYS), stem
        assert record["versions"]["torch"] and record["versions"]["transformers"], stem
        if record.get("image"):
            assert (REPO / "docs" / "results" / record["image"]).is_file(), stem


RESULT_LINK = re.compile(r"results(?:\.md#|/)([a-z0-9_]+)")
"""A page's citation of a results entry: ``results.md#stem`` or ``results/stem.json``."""


def test_every_results_entry_is_one_run_that_a_page_cites():
    """One commit (no "-dirty", no prose), one command line, and a citation from the README or
    a page of docs/ (its status table or the text that rests on it); every citation resolves."""
    stems = {stem for stem, _ in load_results(REPO / "docs" / "results")}
    for stem, record in load_results(REPO / "docs" / "results"):
        assert re.fullmatch(r"[0-9a-f]{7,40}", record["commit"]), (stem, record["commit"])
        command = record["command"]
        assert "\n" not in command and "git checkout" not in command, stem
        assert re.match(r"(python|specforge|torchrun|for \w+ in) ", command), (stem, command)
    cited = set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if page.name == "results.md":
            continue
        for stem in RESULT_LINK.findall(page.read_text()):
            assert stem in stems, f"{page.name} cites {stem}, which docs/results/ lacks"
            cited.add(stem)
    assert sorted(stems - cited) == [], "results entries no page cites"


def test_the_results_page_keeps_current_figures_apart_from_decisions():
    page = (REPO / "docs" / "results.md").read_text()
    assert len(page.splitlines()) < 400
    figures, decisions = page.index("## Current figures"), page.index("## Decisions (A/B)")
    assert figures < page.index('id="quickstart_cpu"') < decisions
    assert decisions < page.index('id="eagle31_equal_time_cpu"')


def test_a_benchmark_writes_its_page_keys_beside_its_figures(tmp_path):
    """``write_result``'s page keywords (``figures`` among them) reach the file with the
    provenance, and the file loads as a results record."""
    record = write_result(
        tmp_path / "run.json", {"rows": [1, 2]}, title="t", summary="s", figures={"x": 1}
    )
    assert json.loads((tmp_path / "run.json").read_text()) == record
    assert record["figures"] == {"x": 1} and record["rows"] == [1, 2]
    assert [stem for stem, _ in load_results(tmp_path)] == ["run"]


def test_a_results_file_without_provenance_is_refused(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"title": "t", "summary": "s", "figures": {}}))
    with pytest.raises(UserError, match="run.json.*needs"):
        load_results(tmp_path)


# ---------------------------------------------------------------------------------------------
# Every documented command line


def shell_commands(text: str) -> list[str]:
    """The command lines of a page: each line of its fenced code blocks (continuations joined)
    and each inline code span that starts with ``specforge``, ``&&`` chains split."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            commands += [part.strip() for part in line.split("&&")]
    for span in re.findall(r"(?<!`)`(specforge [^`]+)`(?!`)", text):
        commands += [part.strip() for part in span.split("&&")]
    return [c for c in commands if c.startswith(("specforge ", "torchrun "))]


def documented_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every ``specforge`` / ``torchrun`` line of the README, the docs
    pages and the shipped recipes' opening lines."""
    found = [(p.name, c) for p in DOC_FILES for c in shell_commands(p.read_text())]
    for recipe in RECIPES:
        first = recipe.read_text().splitlines()[0].removeprefix("# ")
        found += [(recipe.name, part.strip()) for part in first.split("&&")]
    return found


def check_command(command: str) -> None:
    """Parse a documented command with the real command line: unknown flags exit, unknown
    config keys and bad values raise :class:`ConfigError`."""
    words = shlex.split(os.path.expandvars(command), comments=True)
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        launch = get_args_parser().parse_args(words[1:])
        words = [SCRIPT_STAGES[Path(launch.training_script).name], *launch.training_script_args]
    else:
        words = words[1:]
    if "--help" in words:  # prints the help and exits 0
        with pytest.raises(SystemExit) as exited:
            parse_args(words)
        assert exited.value.code == 0
        return
    args = parse_args(words)
    try:
        recipe_path(args.config) if args.config else None
    except ConfigError:  # a placeholder such as FILE: check the flags and overrides alone
        load_config(None, [*args.stage.overrides, *args.overrides])
        args.config = None
    stage_config(args)


def test_documents_hold_commands():
    where = {name for name, _ in documented_commands()}
    assert {"README.md", "data.md", "training.md", "distributed.md"} <= where
    assert {recipe.name for recipe in RECIPES} <= where


@pytest.mark.parametrize(("where", "command"), documented_commands())
def test_every_documented_command_parses(where, command, monkeypatch):
    monkeypatch.chdir(REPO)
    for name, value in PLACEHOLDERS.items():
        monkeypatch.setenv(name, value)
    check_command(command)


@pytest.mark.parametrize(
    "command",
    [
        "specforge prepare --no-such-flag 1",
        "specforge train --config configs/smollm2-135m-eagle3.yaml train.no_such_key=1",
        "torchrun --nproc_per_node=1 scripts/train_eagle3.py --config FILE train.lr=fast",
        "specforge quickstart --config FILE --num-steps -3",
    ],
)
def test_the_command_check_rejects_unknown_flags_and_keys(command, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises((SystemExit, UserError)):  # ConfigError is a UserError
        check_command(command)


# ---------------------------------------------------------------------------------------------
# The end-to-end example, on a tiny stand-in target


def example_block(marker: str) -> list[str]:
    """The command lines of the fenced block after ``<!-- example: marker -->`` in the README."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"<!-- example: {marker} -->")
    block = text[start : text.index("```\n", text.index("```", start) + 3) + 4]
    return [
        line.strip()
        for line in block.split("\n", 1)[1].replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "```"))
    ]


def stand_in(tiny_target_dir: Path) -> list[str]:
    """Overrides that make a real-size recipe run on the tiny target in seconds on a CPU."""
    return [
        f"target.name_or_path={tiny_target_dir}",
        "target.device=cpu",
        "target.dtype=float32",
        "data.max_length=96",
        "vocab.draft_vocab_size=64",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.dtype=float32",
        "train.eval_fraction=0.25",
        "train.eval_every=1",
        "train.save_every=2",
        "bench.max_new_tokens=8",
    ]


def write_example_inputs(folder: Path) -> None:
    """``sharegpt.json`` and ``question.jsonl``, as the example names them."""
    records = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"count to {i}"},
                {"from": "gpt", "value": "one two three four five " * (1 + i % 3)},
            ],
        }
        for i in range(8)
    ]
    (folder / "sharegpt.json").write_text(json.dumps(records))
    question = {"question_id": 81, "category": "writing", "turns": ["write", "again"]}
    (folder / "question.jsonl").write_text(json.dumps(question) + "\n")


@pytest.mark.integration
def test_the_your_model_example_runs_on_a_tiny_stand_in(tmp_path, tiny_target_dir, monkeypatch):
    """The README's "your model on N GPUs" block, line by line, from a folder that holds only
    the checkout's configs and scripts: prepare, torchrun training (one rank), export, and the
    bench through SGLang's protocol, answered by a loopback server that runs the exported
    draft. The serving engines' own launch lines are the ones not run here."""
    from specforge.config import TargetConfig
    from specforge.models.target import load_target
    from specforge.serving.export import load_exported_draft
    from specforge.serving.speculative import SpeculativeDecoder

    lines = example_block("your-model")
    assert [line.split()[0] for line in lines] == [
        *("specforge", "torchrun", "specforge", "python", "vllm", "specforge")
    ]
    for name in ("configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    write_example_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    overrides = stand_in(tiny_target_dir)
    run = [line for line in lines if line.startswith(("specforge", "torchrun"))]
    prepare, train, export, bench = run
    assert run_stage(prepare, overrides) == 0
    words = shlex.split(train)
    words = [w.replace("--nproc_per_node=8", "--nproc_per_node=1") for w in words[1:]]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", *words, *overrides],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert run_stage(export, overrides) == 0
    export_dir = tmp_path / "outputs" / "llama3.1-8b-eagle3" / "export"
    assert (export_dir / "model.safetensors").is_file() and (export_dir / "config.json").is_file()
    target, _ = load_target(TargetConfig(str(tiny_target_dir), dtype="float32"))
    draft = load_exported_draft(
        export_dir,
        target_config=target.config,
        target_embedding=target.get_input_embeddings().weight,
    )
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 1, 0], num_steps=3)
    with sglang_loopback(decoder) as (url, served):
        bench = re.sub(r"--url \S+", f"--url {url}", bench)
        assert run_stage(bench, overrides) == 0
    result = json.loads((tmp_path / "outputs/llama3.1-8b-eagle3/bench/bench.json").read_text())
    assert result["turns"] == 2
    assert result["tau"] == pytest.approx(served["completion_tokens"] / served["spec_verify_ct"])


def run_stage(command: str, overrides: list[str]) -> int:
    """Run a documented ``specforge`` line in-process with the stand-in overrides."""
    args = parse_args([*shlex.split(command)[1:], *overrides])
    return args.stage.run(args, stage_config(args))


# ---------------------------------------------------------------------------------------------
# The project describes itself


CHRONICLE = re.compile(
    r"\bstop \d+\b|\bsessions?\b|\bthe issue'?s?\b|\bthis machine\b|\bleases?\b"
    r"|\ba day earlier\b|\bthe runs? before (it|this)\b|\bsince moved\b|; fixed\)"
    r"|\bnothing else running\b",
    flags=re.IGNORECASE,
)
"""Wording about how the project was made ("stop 40", "this session's Zen 4", "the issue's
2.5", "a day earlier", "(...; fixed)"), which belongs in git history, not in the project; a
measurement's conditions belong in its results file's keys (``"alone": true``), not in prose."""


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    suffixes = {".py", ".md", ".yaml", ".json", ".jsonl", ".cpp", ".toml", ".txt", ""}
    return [
        REPO / name
        for name in listed
        if Path(name).suffix in suffixes
        and (REPO / name).is_file()
        and name != "tests/test_docs.py"
    ]


def test_the_project_never_describes_how_it_was_made():
    found = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if CHRONICLE.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert found == []


def test_the_wording_check_bites():
    assert CHRONICLE.search("the kernel of stop 40")
    assert CHRONICLE.search("this session's Zen 4")
    assert CHRONICLE.search("The issue's 2.5 is not reached")
    assert not CHRONICLE.search("stops at its 6000 steps")
    assert CHRONICLE.search("in the time the lease allowed it")
    assert CHRONICLE.search("2910 steps a day earlier")
    assert CHRONICLE.search("where the run before it made 1860")
    assert CHRONICLE.search("(training failed at start-up; fixed)")
    assert CHRONICLE.search("one after the other, nothing else running")
    assert not CHRONICLE.search("a release of vLLM")


def test_the_engine_table_lists_the_vllm_the_suite_pins():
    """docs/export-and-serving.md names the vLLM version the suite serves exports with."""
    assert f"| {VLLM_PIN.split('==')[1]} |" in vllm_rows()


# -- figures and settings in prose agree with their sources ------------------------------------

RESULTS_LINK = re.compile(r"results\.md#([a-z0-9_]+)")
FIGURE = re.compile(r"(?<![\w.#])([+-]?)(\d+\.\d+)(?![\w.])")
PASSAGES = re.compile(r"\n\s*\n|\n(?=\|)|\n(?=- )|(?<=[a-z0-9)`])\.\s+(?=[A-Z`(])")
"""Where a document's passages end: a blank line, a table row, a list item, a sentence."""


def _numbers(value) -> list[float]:
    """Every number a results entry holds (in strings too: its figures and summary)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [n for item in value for n in _numbers(item)]
    if isinstance(value, str):
        return [float(n) for n in re.findall(r"\d+\.\d+|\d+", value)]
    return []


def _shown(value: float, text: str) -> bool:
    """Whether ``text`` (a decimal as written) shows ``value``, or ``value`` as a percentage."""
    places = len(text.split(".")[1])
    return any(round(v, places) == float(text) for v in (value, 100 * value))


def unsourced_figures(text: str, results: Path) -> list[str]:
    """The decimals in ``text``'s passages that link a results entry (a table row: its last
    cell) that no linked entry holds, as written or as a percentage; a signed one (``+0.022``)
    may be a difference of two of its values. A link to another site and its text are not
    figures of ours."""
    found = []
    for passage in PASSAGES.split(text):
        keys = set(RESULTS_LINK.findall(passage))
        if not keys:
            continue
        if passage.startswith("|"):
            passage = passage.rstrip(" |").rsplit("|", 1)[-1]
        passage = re.sub(r"\[[^\]]*\]\(https?://[^)]*\)", "", passage)
        values = sorted(
            {
                v
                for key in keys
                if (results / f"{key}.json").is_file()
                for v in _numbers(json.loads((results / f"{key}.json").read_text()))
            }
        )
        for match in FIGURE.finditer(passage):
            sign, text_value = match.groups()
            if any(_shown(v, text_value) for v in values):
                continue
            if sign and any(_shown(abs(a - b), text_value) for a in values for b in values):
                continue
            found.append(f"{text_value} beside {sorted(keys)}: {passage.strip()[:120]!r}")
    return found


@pytest.mark.parametrize("page", DOC_FILES, ids=lambda p: p.name)
def test_every_figure_beside_a_results_link_is_in_that_result(page):
    """A figure in prose comes from the results entry it links: a figure of a superseded draft,
    or one read off another run, fails here."""
    assert unsourced_figures(page.read_text(), REPO / "docs" / "results") == []


def test_the_figure_check_bites(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"tau": 1.5312, "speedup": 1.2}))
    ok = "The draft's `tau` 1.53, 1.20x ([results](results.md#run)). Another: 2.5."
    assert unsourced_figures(ok, tmp_path) == []
    stale = "The draft's `tau` 1.63 ([results](results.md#run))."
    assert len(unsourced_figures(stale, tmp_path)) == 1
    assert unsourced_figures("| a | `tau` +0.33 ([r](results.md#run)) |", tmp_path) == []


SETTINGS_RECIPE = REPO / "configs" / "smollm2-135m-eagle3.yaml"


def _setting(cfg, dotted: str):
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def test_the_settings_table_says_the_codes_defaults_and_the_recipes_values():
    """``docs/training.md``'s settings table: its default column is the dataclasses' default
    and its recipe column the SmolLM2 recipe's value, key by key."""
    import yaml

    from specforge.config import SpecForgeConfig

    text = (REPO / "docs" / "training.md").read_text()
    table = text[text.index("| setting | default | SmolLM2 recipe | why |") :].split("\n\n")[0]
    defaults, recipe = SpecForgeConfig(), load_config(SETTINGS_RECIPE)
    checked = 0
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        keys = re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", cells[0])
        for column, cfg in ((1, defaults), (2, recipe)):
            shown = re.findall(r"`([^`]+)`", cells[column])
            assert len(shown) == len(keys), row
            for key, value in zip(keys, shown, strict=True):
                parsed = yaml.safe_load(value)
                if isinstance(parsed, str):  # YAML 1.1 reads 1e-4 as a string
                    parsed = float(parsed) if re.fullmatch(r"[\d.]+e-?\d+", parsed) else parsed
                assert parsed == _setting(cfg, key), (key, column, value)
                checked += 1
    assert checked >= 30


def test_ci_installs_and_tests_as_the_readme_says():
    """``.ci/run`` runs the README's test command as written (read by .ci/readme_command.py):
    the install line a user copies, with the CPU index for torch, then ``pytest``."""
    done = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "readme_command.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    install, test = done.stdout.splitlines()
    assert install.startswith("pip install torch==2.13.0 --extra-index-url ")
    assert test == "pytest"
    ci = (REPO / ".ci" / "run").read_text()
    assert "readme_command.py" in ci and "pip install" not in ci


def test_the_readme_says_what_the_engine_table_says_has_served():
    """The README's claims about serving follow ``docs/export-and-serving.md``'s engine table:
    an engine the table marks as not served here is said so in the README too."""
    rows = [
        line
        for line in (REPO / "docs" / "export-and-serving.md").read_text().splitlines()
        if line.startswith("| SGLang |") or line.startswith("| vLLM")
    ]
    readme = " ".join((REPO / "README.md").read_text().split())
    for row in rows:
        engine = row.split("|")[1].strip()
        if "not served here" in row:
            assert f"{engine} has not served an export here" in readme, engine
    assert "serve it with SGLang (its documented launch; not yet run here)" in readme


def test_every_list_of_question_sets_names_them_all():
    """A page that lists ``--questions``' named sets (the README, the quickstart, the bench
    page) names every set the code has (:data:`specforge.data.questions.EVAL_SETS`)."""
    from specforge.data.questions import EVAL_SETS

    pages = {page.name: " ".join(page.read_text().split()) for page in DOC_FILES}
    for name in ("README.md", "quickstart.md", "bench-and-runtime.md"):
        assert "mt_bench" in pages[name], name
    for name, text in pages.items():
        if "`gsm8k`" in text:
            missing = [s for s in EVAL_SETS if f"`{s}`" not in text and f",{s}" not in text]
            assert not missing, (name, missing)


def test_a_recipe_says_only_what_it_sets():
    """A shipped recipe's header names a setting in parentheses only where the recipe sets it,
    and promises a dataset only where ``data.inputs`` lists one or the header says the data
    comes from ``--data`` (a recipe promised ShareGPT + UltraChat with ``inputs: []``)."""
    import yaml

    for path in sorted((REPO / "configs").glob("*.yaml")):
        text = path.read_text()
        header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
        values = yaml.safe_load(text) or {}
        for key in re.findall(r"\(([a-z_]+\.[a-z_.]+)\)", header):
            node = values
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"{path.name}: {key} not set"
                node = node[part]
        inputs = values.get("data", {}).get("inputs")
        for dataset in ("ShareGPT", "UltraChat"):
            if dataset in header and not inputs:
                said = "--data" in header or "data.inputs=" in header
                assert said, f"{path.name} names {dataset} but lists no inputs"


DEFAULT_CLAIM = re.compile(r"`([a-z_]+\.[a-z_.]+)`[^.;|`]{0,60}?\(([\w.-]+) by default")


def test_a_default_stated_in_prose_is_the_codes():
    """``(N by default)`` after a config key in any page is that key's dataclass default (a
    page said 7 for ``train.ttt_length`` where another said 3)."""
    import yaml

    from specforge.config import SpecForgeConfig

    defaults, checked = SpecForgeConfig(), 0
    sections = {f.name for f in dataclasses.fields(SpecForgeConfig)}
    for page in DOC_FILES:
        for key, value in DEFAULT_CLAIM.findall(" ".join(page.read_text().split())):
            if key.split(".")[0] not in sections:
                continue
            assert yaml.safe_load(value) == _setting(defaults, key), (page.name, key, value)
            checked += 1
    assert checked >= 1
