"""Loading task sets: JSONL files, generated directories, the embedded micro set, and SWE datasets.

    load_tasks("tasks.jsonl")                        # a JSONL file: one Task row per line
    load_tasks("out/")                               # a directory holding tasks.jsonl
    load_tasks("micro-train")                        # the embedded micro set (generated on first use)
    load_tasks("SWE-Gym/SWE-Gym")                    # a Hugging Face dataset, through its adapter
    load_tasks("copy/", adapter="swe-gym")           # a local save_to_disk copy (or a .parquet file)

Every row is validated by Task.from_row and the first bad row aborts the load with a message that
says where (FILE:LINE, or DATASET[split] row N) and what was expected; nothing is half-loaded.
Dataset rows pass through one adapter per source that fills what swebench 5.x needs to run a task
(image, test command, log parser) by that source's conventions.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crr.errors import CRRError, TaskFormatError
from crr.sandbox.checkout import building, cache_root
from crr.tasks.micro import generate_micro
from crr.tasks.schema import (
    DEFAULT_LOG_PARSER,
    KNOWN_EXTRA,
    TASKS_FILE,
    Task,
    _validated,
    read_tasks_jsonl,
    write_tasks,  # noqa: F401  (write_tasks: the task-file API lives in schema.py)
)

log = logging.getLogger(__name__)

# Named generated sets (registered in TASK_SETS below): name -> (tier,
# split); each is generated on first use, MICRO_DEFAULT_N[tier] tasks from index 0 unless MICRO_RANGES gives
# (first index, n). Task i of a split depends on (tier, seed, split, i) only, so ranges of one split are disjoint.
# nano-test is the committed results' benchmark (its 64 tasks); they were used to choose recipes, so they are
# also named nano-dev, and figures reported from now on use nano-test2 (test tasks 64-319, never looked at).
# The val splits draw from the test vocabulary with instances of their own (crr.tasks.micro).
MICRO_SETS = {"micro-train": ("default", "train"), "micro-test": ("default", "test"),
              "nano-train": ("nano", "train"), "nano-test": ("nano", "test"),
              "nano-dev": ("nano", "test"), "nano-val": ("nano", "val"), "nano-test2": ("nano", "test"),
              "multi-train": ("multi", "train"), "multi-val": ("multi", "val"), "multi-test": ("multi", "test")}
MICRO_DEFAULT_N = {"default": 32, "nano": 64, "multi": 64}
MICRO_RANGES = {"nano-test2": (64, 256), "nano-val": (0, 256), "multi-val": (0, 256), "multi-test": (0, 256)}
MICRO_DEFAULT_SEED = 0
# A tier whose generated rows change gets a new version, so that sets cached before it are generated again rather
# than read (multi 2: rows carry run_tests_cmd).
MICRO_VERSION = {"multi": 2}

# Test commands of the SWE-bench repositories whose runner is not plain pytest (swebench 4.x
# harness/constants/python.py; 5.x dropped these per-repo specs, so rows of the old schema need them).
SWEBENCH_TEST_CMD = {
    "astropy/astropy": "pytest -rA -vv -o console_output_style=classic --tb=no -p no:nose",
    "django/django": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
    "mwaskom/seaborn": "pytest --no-header -rA",
    "sphinx-doc/sphinx": "tox --current-env -epy39 -v --",
    "sympy/sympy": "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
}
SWEBENCH_DEFAULT_TEST_CMD = "pytest -rA"
# SWE-bench images keep the test environment in conda (swebench 4.x eval scripts activate it first);
# guarded, so that the script runs unchanged where no conda is installed.
ACTIVATE_TESTBED = ("if [ -f /opt/miniconda3/bin/activate ]; then "
                    "source /opt/miniconda3/bin/activate && conda activate testbed; fi")


# ------------------------------------------------------------------------------------ named sets

@dataclass(frozen=True)
class TaskSet:
    """A task set by name: `load_tasks(name)`, `crr eval NAME`, a comparison's eval dataset, `crr tasks sets`."""
    name: str
    what: str                                   # one line for `crr tasks sets`
    load: Callable[[str | None], list[Task]]    # split (None: the set's own) -> the set's tasks
    dataset: str | None = None                  # a hub dataset's id: `crr eval NAME DIR` reads a local copy of it


# The one catalogue of named task sets; a new set is one register_task_set call (crr's own are below).
TASK_SETS: dict[str, TaskSet] = {}


def register_task_set(name: str, what: str, load: Callable[[str | None], list[Task]], *,
                      dataset: str | None = None) -> TaskSet:
    """Name a task set for load_tasks, `crr eval` and `crr tasks sets` (a name registered again is replaced)."""
    TASK_SETS[name] = TaskSet(name, what, load, dataset)
    return TASK_SETS[name]


def _generated(name: str, tier: str, split: str) -> Callable[[str | None], list[Task]]:
    def load(asked: str | None) -> list[Task]:
        if asked is not None and asked != split:
            raise CRRError(f"{name} is the {split} split already; drop --split {asked}")
        first, n = MICRO_RANGES.get(name, (0, None))
        return load_micro(split, n=n, tier=tier, first=first)
    return load


def _shipped(name: str, directory: Path) -> Callable[[str | None], list[Task]]:
    def load(split: str | None) -> list[Task]:
        _no_split(name, split)
        return read_tasks_jsonl(directory / TASKS_FILE)
    return load


def _hub(dataset: str) -> Callable[[str | None], list[Task]]:
    return lambda split: _load_dataset_rows(dataset, split, None)


# ------------------------------------------------------------------------------------ entry points

def hub_dataset(source: str) -> bool:
    """Whether load_tasks reads `source` from the Hugging Face hub: a dataset name (owner/name), not a named set
    or a local path."""
    path = Path(source).expanduser()
    return (source not in TASK_SETS and not path.exists() and path.suffix not in (".jsonl", ".json", ".parquet")
            and not source.startswith((".", "/", "~")) and re.fullmatch(r"[\w.-]+/[\w.-]+", source) is not None)


def load_tasks(source: str, split: str | None = None, *, adapter: str | None = None) -> list[Task]:
    """Tasks from a named set (TASK_SETS), a JSONL file, a directory with tasks.jsonl, or a dataset."""
    if source in TASK_SETS:
        return TASK_SETS[source].load(split)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".parquet":
        return _load_dataset_rows(source, split, adapter, local=path)
    if path.is_file():
        _no_split(source, split)
        return read_tasks_jsonl(path)
    if path.is_dir():
        if (path / TASKS_FILE).is_file():
            _no_split(source, split)
            return read_tasks_jsonl(path / TASKS_FILE)
        if any((path / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return _load_dataset_rows(source, split, adapter, local=path)
        raise CRRError(f"{path} holds neither {TASKS_FILE} nor a datasets save_to_disk copy; "
                       f"pass a task file, a directory made by `crr tasks micro`, or a dataset")
    if path.suffix in (".jsonl", ".json", ".parquet") or source.startswith((".", "/", "~")):
        raise CRRError(f"{source} does not exist; check the path")
    if hub_dataset(source):
        return _load_dataset_rows(source, split, adapter)
    raise CRRError(f"{source!r} is not a file, a directory, a named set ({', '.join(TASK_SETS)}) "
                   "or a dataset name like SWE-Gym/SWE-Gym")


def load_task(source: str, instance_id: str) -> Task:
    """One task of a source (as load_tasks takes it) by its instance id."""
    by_id = {t.instance_id: t for t in load_tasks(source)}
    if instance_id not in by_id:
        raise CRRError(f"no task {instance_id!r} in {source}; it has e.g. {', '.join(list(by_id)[:5]) or 'none'}")
    return by_id[instance_id]


def load_micro(split: str, n: int | None = None, seed: int | None = None, tier: str = "default",
               workers: int = 2, first: int = 0) -> list[Task]:
    """The embedded micro set of `tier` (tasks first..first+n-1), generated once per machine under the crr cache."""
    n = MICRO_DEFAULT_N[tier] if n is None else n
    seed = MICRO_DEFAULT_SEED if seed is None else seed
    version = MICRO_VERSION.get(tier, 1)
    stem = ((split if tier == "default" else f"{tier}-{split}") + (f"-v{version}" if version > 1 else "")
            + (f"-from{first}" if first else ""))
    # task i depends on (tier, seed, split, i) only: a larger cached set holds this one as its prefix
    larger = sorted((int(m[1]), d) for d in (cache_root() / "micro").glob(f"{stem}-*-{seed}")
                    if (m := re.fullmatch(rf"{re.escape(stem)}-(\d+)-{seed}", d.name)) and int(m[1]) >= n
                    and (d / TASKS_FILE).is_file())
    if larger:
        return read_tasks_jsonl(larger[0][1] / TASKS_FILE)[:n]
    target = cache_root() / "micro" / f"{stem}-{n}-{seed}"
    if not (target / TASKS_FILE).is_file():
        log.info("generating the %s %s set (n=%d, seed=%d) into %s", tier, split, n, seed, target)
        # generated beside the target and renamed into place, so concurrent first uses are safe
        with building(target, keep_theirs=lambda d: (d / TASKS_FILE).is_file()) as built:
            generate_micro(built, n=n, seed=seed, split=split, tier=tier, workers=workers, first=first)
    return read_tasks_jsonl(target / TASKS_FILE)


def _no_split(source: str, split: str | None) -> None:
    if split is not None:
        raise CRRError(f"--split applies to datasets; {source} is a task file, drop --split {split}")


# ------------------------------------------------------------------------------------ datasets

def _image_swebench(instance_id: str, namespace: str = "swebench") -> str:
    from swebench.task.checks import expected_image  # deferred here and below: swebench takes ~1 s to import

    return expected_image(instance_id, namespace)


def _parser_name(name: str | None, repo: str | None = None) -> str:
    """A swebench PARSER_REGISTRY key from a dataset's parser field or, failing that, the repo."""
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY

    if name:
        return name if name in PARSER_REGISTRY or f"parse_log_{name}" not in PARSER_REGISTRY else f"parse_log_{name}"
    if repo in MAP_REPO_TO_PARSER_PY:
        return MAP_REPO_TO_PARSER_PY[repo].__name__
    return DEFAULT_LOG_PARSER


def _common(row: dict) -> dict:
    """The Task fields and known dataset fields of a row; any other column goes to metadata."""
    own = set(Task.__dataclass_fields__) - {"extra"}
    out = {k: v for k, v in row.items() if (k in own or k in KNOWN_EXTRA) and v is not None}
    other = {k: v for k, v in row.items() if k not in out and k not in own and k not in KNOWN_EXTRA}
    if other:
        out["metadata"] = {**other, **(out.get("metadata") or {})}
    return out


def swebench_row(row: dict) -> dict:
    """SWE-bench (princeton-nlp/SWE-bench_Verified, and the 5.x SWE-bench/SWE-bench_Verified with its
    image/eval_script/log_parser columns)."""
    out = _common(row)
    out["image"] = row.get("image") or _image_swebench(row["instance_id"])
    out["log_parser"] = _parser_name(row.get("log_parser"), row.get("repo"))
    out["test_cmd"] = SWEBENCH_TEST_CMD.get(row.get("repo"), SWEBENCH_DEFAULT_TEST_CMD)
    if not out.get("eval_script"):
        out["eval_script"] = swebench_eval_script(Task.from_row(out))
    return out


def swebench_eval_script(task: Task) -> str:
    """The eval script swebench 4.x made for an old-schema row: activate the testbed environment, then
    (as crr's verifier) reset and patch the test files and run test_cmd, here on the test files of the
    test patch as the official harness does. Django's and SymPy's held-out ids ("test_x (mod.Class)")
    are not runner arguments, and truncated pytest ids (swebench #290) would abort the run."""
    from unidiff.errors import UnidiffParseError

    # deferred: evalscript imports swebench, ~1.3 s that loading task files need not pay
    from crr.tasks.evalscript import eval_script_lines, test_directives

    try:
        lines = eval_script_lines(task, targets=test_directives(task))
    except UnidiffParseError as e:
        raise TaskFormatError(f"field 'test_patch': not a parsable diff ({e})") from None
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", ACTIVATE_TESTBED, *lines]) + "\n"


def swe_gym_row(row: dict) -> dict:
    """SWE-Gym: no image column; OpenHands' rule names the image with `__` -> `_s_`."""
    out = _common(row)
    # hand-written: swebench knows only the `_1776_` convention of its own images
    key = f"sweb.eval.x86_64.{row['instance_id']}".replace("__", "_s_")
    out["image"] = f"xingyaoww/{key}:latest".lower()
    out["log_parser"] = _parser_name(row.get("log_parser"))
    out["test_cmd"] = SWEBENCH_DEFAULT_TEST_CMD
    return out


def swe_rebench_row(row: dict) -> dict:
    """nebius/SWE-rebench: image in `docker_image`, test command and parser in `install_config`."""
    out = _common(row)
    # rows without an image column name theirs by the leaderboard's rule (namespace swerebench)
    out["image"] = row.get("docker_image") or row.get("image_name") or _image_swebench(row["instance_id"], "swerebench")
    config = row.get("install_config") or {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            raise TaskFormatError("field 'install_config': expected an object or its JSON text") from None
    if not isinstance(config, dict):
        raise TaskFormatError("field 'install_config': expected an object")
    out["log_parser"] = _parser_name(config.get("log_parser"))
    test_cmd = config.get("test_cmd")
    out["test_cmd"] = _one_command(test_cmd) if test_cmd else SWEBENCH_DEFAULT_TEST_CMD
    return out


def swe_bench_live_row(row: dict) -> dict:
    """SWE-bench-Live: `test_cmds` list, short parser names ("pytest"), optional docker_image."""
    out = _common(row)
    out["image"] = row.get("docker_image") or _image_swebench(row["instance_id"], "starryzhang")
    out["log_parser"] = _parser_name(row.get("log_parser"))
    out["test_cmd"] = _one_command(row.get("test_cmds")) if row.get("test_cmds") else SWEBENCH_DEFAULT_TEST_CMD
    out.setdefault("version", "none")  # the Live fork's default for rows without a version
    return out


def generic_row(row: dict) -> dict:
    """Any SWE-bench-shaped dataset: Task fields as they are; `docker_image`/`image_name` as image."""
    out = _common(row)
    if "image" not in out and (row.get("docker_image") or row.get("image_name")):
        out["image"] = row.get("docker_image") or row.get("image_name")
    if "log_parser" in out:
        out["log_parser"] = _parser_name(out["log_parser"])
    return out


def _one_command(cmd: str | list[str]) -> str:
    if isinstance(cmd, list):
        return " && ".join(str(c) for c in cmd)
    return str(cmd)


ADAPTERS: dict[str, Callable[[dict], dict]] = {
    "swe-bench": swebench_row,
    "swe-gym": swe_gym_row,
    "swe-rebench": swe_rebench_row,
    "swe-bench-live": swe_bench_live_row,
    "generic": generic_row,
}
# dataset name -> (adapter, default split)
DATASETS: dict[str, tuple[str, str]] = {
    "princeton-nlp/SWE-bench_Verified": ("swe-bench", "test"),
    "SWE-bench/SWE-bench_Verified": ("swe-bench", "test"),
    "SWE-bench-Live/SWE-bench-Live": ("swe-bench-live", "verified"),
    "nebius/SWE-rebench": ("swe-rebench", "test"),
    "SWE-Gym/SWE-Gym": ("swe-gym", "train"),
}


def dataset_adapter(dataset: str) -> str:
    """The adapter that reads a dataset's rows (and a local copy of it): generic for a dataset crr does not know."""
    return _adapter(None, dataset)[0]


def _adapter(name: str | None, source: str) -> tuple[str, Callable[[dict], dict]]:
    if name is None:
        name = DATASETS.get(source, ("generic", ""))[0]
    name = DATASETS[name][0] if name in DATASETS else name
    if name not in ADAPTERS:
        raise CRRError(f"unknown adapter {name!r}; use one of {', '.join(ADAPTERS)} or a dataset name "
                       f"({', '.join(DATASETS)})")
    return name, ADAPTERS[name]


def _load_dataset_rows(source: str, split: str | None, adapter: str | None,
                       local: Path | None = None) -> list[Task]:
    adapter_name, to_row = _adapter(adapter, source)
    dataset, split = _open_dataset(source, split, local)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(dataset):
        where = f"{source}[{split}] row {i}"
        if isinstance(row, dict) and isinstance(row.get("instance_id"), str):
            where += f" ({row['instance_id']})"
        try:
            mapped = to_row(row)
        except (KeyError, TypeError) as e:
            raise TaskFormatError(f"{where}: the {adapter_name} adapter could not read the row "
                                  f"(missing or malformed {e}); is this the right --adapter?") from None
        except TaskFormatError as e:
            raise TaskFormatError(f"{where}: {e}") from None
        task = _validated(mapped, where)
        if task.instance_id in seen:
            raise TaskFormatError(f"{where}: duplicate instance_id {task.instance_id!r} "
                                  f"(first in row {seen[task.instance_id]})")
        seen[task.instance_id] = i
        tasks.append(task)
    log.info("loaded %d tasks from %s[%s] with the %s adapter", len(tasks), source, split, adapter_name)
    return tasks


def _open_dataset(source: str, split: str | None, local: Path | None):
    import datasets  # deferred: a heavy library that task files need not load

    if local is not None and local.suffix == ".parquet":
        return datasets.load_dataset("parquet", data_files=str(local), split="train"), split or "train"
    if local is not None:
        data = datasets.load_from_disk(str(local))
        if isinstance(data, datasets.DatasetDict):
            if split is None and len(data) == 1:
                split = next(iter(data))
            if split not in data:
                raise CRRError(f"{source} has splits {sorted(data)}; choose one with --split")
            return data[split], split
        return data, split or "train"
    split = split or DATASETS.get(source, ("", "train"))[1]
    try:
        return datasets.load_dataset(source, split=split), split
    except ConnectionError as e:
        raise CRRError(
            f"could not reach the Hugging Face hub for {source} ({e}). Where the hub is reachable run "
            f"`datasets.load_dataset({source!r}, split={split!r}).save_to_disk(DIR)` (or save a .parquet), "
            f"copy DIR here and make it a task file once: `crr tasks show DIR --adapter {_adapter(None, source)[0]} "
            f"--out tasks.jsonl`; every --tasks option takes tasks.jsonl") from None
    except datasets.exceptions.DatasetNotFoundError:
        raise CRRError(f"dataset {source} was not found on the hub or in the local cache; check the name, "
                       f"or pass a local save_to_disk directory or .parquet file") from None
    except ValueError as e:  # e.g. an unknown split
        raise CRRError(f"could not load {source}[{split}]: {e}") from None


# ------------------------------------------------------------------------------------ crr's own named sets

for _name, (_tier, _split) in MICRO_SETS.items():
    _first, _n = MICRO_RANGES.get(_name, (0, MICRO_DEFAULT_N[_tier]))
    register_task_set(_name, f"generated on first use: {_tier} tier, {_split} split, tasks {_first}-{_first + _n - 1}",
                      _generated(_name, _tier, _split))
# Shipped in the package (tasks.jsonl + repos/): nano-band is the learnable band of the shipped default
# (crr tasks band: the nano-train tasks 2000-2255 it solves in 1-3 of 4 samples; band.json says how).
register_task_set("nano-band",
                  "shipped: the learnable band of the shipped warm start (80 of nano-train tasks 2000-2255)",
                  _shipped("nano-band", Path(__file__).parent / "sets" / "nano-band"))
# multi-band: the same for the multi tier's warm start (crr/policy/multi), on multi-train tasks 2000-2255.
register_task_set("multi-band",
                  "shipped: the learnable band of the multi warm start (51 of multi-train tasks 2000-2255)",
                  _shipped("multi-band", Path(__file__).parent / "sets" / "multi-band"))
# The hub's benchmarks (`crr eval NAME DIR` evaluates a local copy of the dataset)
for _name, _dataset in {"verified": "SWE-bench/SWE-bench_Verified", "live": "SWE-bench-Live/SWE-bench-Live",
                        "rebench": "nebius/SWE-rebench", "gym": "SWE-Gym/SWE-Gym"}.items():
    register_task_set(_name, f"the Hugging Face dataset {_dataset}", _hub(_dataset), dataset=_dataset)
