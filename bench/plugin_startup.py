"""``docker gpu`` start-up through its launcher: this tree against another commit, side by side.

The launcher is the code ``gpumgr plugin install`` writes (``python -I -S``, gpumgr's folders
registered by path: ``plugin/launchers.py``). It is built for this checkout and for ``--base`` (a
commit, copied out with ``git archive``), and the two are run in turns, ``--runs`` times each:

  help  ``docker-gpu gpu --help``: the interpreter and the imports of the command, no call
  ps    ``docker-gpu gpu --manager URL ps``: one REST call to a live ``gpumgr manager`` (no agents)

Each figure is one process, timed from its start to its exit; and, less noisy on a shared machine,

  import  what ``python -X importtime`` reports for importing ``gpumgr.plugin.docker_gpu`` (cumulative)

    python bench/plugin_startup.py [--base main] [--runs 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    ROOT,
    answers,
    free_port,
    gpumgr,
    machine,
    machine_line,
    median,
    save,
    summary,
    table,
    wait_for,
)
from gpumgr.plugin.launchers import CLI_IMPORTS, CLI_MODULE, launcher_code


def base_launcher(ref: str, folder: Path) -> str:
    """The launcher code for commit ``ref``, copied into ``folder``: this tree's code with its folders swapped."""
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return launcher_code(CLI_MODULE, CLI_IMPORTS).replace(str(ROOT), str(folder))


def import_time(code: str) -> float:
    """Seconds ``-X importtime`` gives the import of the plugin's module, everything it imports included."""
    done = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", "-c", code, "gpu", "--help"], check=True,
                          capture_output=True, text=True)
    line = next(x for x in done.stderr.splitlines() if x.rstrip().endswith(f"| {CLI_MODULE}"))
    return int(line.split("|")[1]) / 1e6


def timed(code: str, args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-I", "-S", "-c", code, "gpu", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="main", help="the commit to compare with (default main)")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpumgr-bench-") as tmp:
        codes = {"base": base_launcher(args.base, Path(tmp) / "base"), "this": launcher_code(CLI_MODULE, CLI_IMPORTS)}
        port = free_port()
        manager = gpumgr(["manager", "--api", f"127.0.0.1:{port}", "--agents", f"tcp://127.0.0.1:{free_port()}",
                          "--state-dir", f"{tmp}/state"], Path(tmp) / "manager.log")
        try:
            wait_for(lambda: manager.check() and answers(f"http://127.0.0.1:{port}"), 30, what="the manager")
            commands = {"help": ["--help"], "ps": ["--manager", f"http://127.0.0.1:{port}", "ps"]}
            times: dict[tuple[str, str], list[float]] = {(c, t): [] for c in (*commands, "import") for t in codes}
            for _ in range(args.runs):
                for tree, code in codes.items():
                    for command, argv in commands.items():
                        times[command, tree].append(timed(code, argv))
                    times["import", tree].append(import_time(code))
        finally:
            manager.stop()
    rows = [(f"{c} {t}", *(summary(v, 1000)[k] for k in ("median", "p90"))) for (c, t), v in times.items()]
    table([("command tree", "14"), ("median ms", "10.1f"), ("p90 ms", "8.1f")], rows)
    for command in (*commands, "import"):
        ratio = median(times[command, "this"]) / median(times[command, "base"])
        print(f"{command}: this / {args.base} = {ratio:.3f}")
    info = machine()
    print(machine_line(info))
    save(args.json, "plugin_startup", args, machine=info,
         results={f"{c} {t}": summary(v, 1000) for (c, t), v in times.items()})


if __name__ == "__main__":
    main()
