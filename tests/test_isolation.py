"""Untrusted code stays in its sandbox, on both engines: what a hostile task or a reward-hacking
policy would try from one command (issue 31), each attempt a case, and the memory and disk caps.

Every probe runs in a real sandbox and is judged on the host: the file it tried to write is absent,
the secret it tried to read is not in its output, the base checkout's digest is unchanged.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import git_repo

from crr.errors import SandboxError
from crr.sandbox.base import tree_digest
from crr.sandbox.checkout import base_checkout
from crr.tasks.schema import Task

FILES = {"README.md": "hello\n", "pkg/__init__.py": "", "pkg/core.py": "def f():\n    return 1\n"}
TOKEN = uuid.uuid4().hex  # what the host's loopback server answers, and the host's secret holds


def _task(root: Path) -> Task:
    repo = root / "repo"
    repo.mkdir()
    return Task(instance_id="iso-1", repo="local/iso", base_commit=git_repo(repo, FILES), problem_statement="",
                patch="", test_patch="", FAIL_TO_PASS=(), PASS_TO_PASS=(), version="0", repo_src=str(repo))


def _engine(name: str, **caps):
    if name == "local":
        from crr.sandbox.local import LocalEngine

        return LocalEngine(**caps)
    from crr.sandbox.docker import DockerEngine, docker_client

    try:
        docker_client()
    except SandboxError as e:
        pytest.skip(str(e))
    return DockerEngine(**caps)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """What a sandbox must not reach: a secret in /root and in the working dir, and a server on the
    host's loopback."""
    root = tmp_path_factory.mktemp("iso")
    secrets = [Path("/root") / f"crr-secret-{TOKEN[:8]}", root / "secret.txt"]
    for s in secrets:
        s.write_text(TOKEN)
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve, args=(server,), daemon=True).start()
    yield {"root": root, "secrets": secrets, "port": server.getsockname()[1], "task": _task(root)}
    server.close()
    for s in secrets:
        s.unlink(missing_ok=True)


def _serve(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.sendall(TOKEN.encode())


@pytest.fixture(scope="module", params=["local", "docker"])
def engine(request):
    eng = _engine(request.param)
    yield eng
    eng.close()


# name -> (command, refused(output, host) judged on the host). {...} are filled from `host`.
PROBES: dict[str, tuple[str, Callable[[str, dict], bool]]] = {
    "write /root": ("echo pwned > /root/crr-probe-{tag}",
                    lambda out, h: not Path(f"/root/crr-probe-{h['tag']}").exists()),
    "write the working dir": ("echo pwned > {cwd}/crr-probe-{tag}; echo pwned > {root}/crr-probe-{tag}",
                              lambda out, h: not (Path(h["cwd"]) / f"crr-probe-{h['tag']}").exists()
                              and not (h["root"] / f"crr-probe-{h['tag']}").exists()),
    "read a secret in /root and the working dir": ("cat {secret0} {secret1}", lambda out, h: TOKEN not in out),
    "read the host's /etc/shadow": ("stat -c '%d:%i' /etc/shadow; cat /etc/shadow",
                                    lambda out, h: h["shadow"] not in out.split()),
    "list host processes": ("ls /proc; cat /proc/{pid}/environ",
                            lambda out, h: str(h["pid"]) not in out.split() and "PATH=" not in out
                            and sum(w.isdigit() for w in out.split()) < 10),
    "reach the host's loopback": ("exec 3<>/dev/tcp/127.0.0.1/{port} && cat <&3", lambda out, h: TOKEN not in out),
    "nsenter a host namespace": ("for t in 1 {pid}; do nsenter -t $t -n -m bash -c "
                                 "'exec 3<>/dev/tcp/127.0.0.1/{port} && cat <&3; cat {secret0}'; done",
                                 lambda out, h: TOKEN not in out),
    "reach the Docker socket": ("for s in /var/run/docker.sock /run/docker.sock; do "
                                "python -c \"import socket,sys; c=socket.socket(socket.AF_UNIX); "
                                "c.connect(sys.argv[1]); c.sendall(b'GET /_ping HTTP/1.0\\r\\n\\r\\n'); "
                                "print(c.recv(99))\" $s; done",
                                lambda out, h: "HTTP/1." not in out),
    # Only this task's checkout, by its host path and as mountinfo shows it: where a sandbox does see the
    # host's mounts (the local engine before issue 31), every sandbox's lower layers on the host are
    # there too, and a probe must not poison other runs' trees.
    "change the shared base checkout": (
        "for p in $(grep -o 'lowerdir=[^, ]*' /proc/self/mountinfo | cut -d= -f2 | tr : '\\n' | grep -xF {base}) "
        "{base}; do echo pwned > $p/README.md; touch $p/poison; done",
        lambda out, h: tree_digest_of(h["base"]) == h["base_digest"]),
}


def tree_digest_of(path: Path) -> str:
    """The files of a host tree (not its .git): tree_digest reads a sandbox, this the checkout itself."""
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if ".git" not in f.parts and f.is_file():
            h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


def probe_all(engine, host: dict) -> dict[str, bool]:
    """name -> refused, for every probe, in one sandbox of `engine` (the table of the issue's note)."""
    task = host["task"]
    base = base_checkout(task)
    st = os.stat("/etc/shadow")
    h = {**host, "tag": uuid.uuid4().hex[:8], "cwd": os.getcwd(), "pid": os.getpid(), "base": base,
         "base_digest": tree_digest_of(base), "shadow": f"{st.st_dev}:{st.st_ino}"}
    fill = {"tag": h["tag"], "cwd": h["cwd"], "root": h["root"], "pid": h["pid"], "port": h["port"],
            "secret0": h["secrets"][0], "secret1": h["secrets"][1], "base": base}
    refused = {}
    with engine.start(task) as sb:
        before = tree_digest(sb)
        for name, (command, judge) in PROBES.items():
            out = sb.exec(command.format(**fill), timeout=20).output
            refused[name] = judge(out, h)
        sb.exec("echo pwned > README.md")
    with engine.start(task) as fresh:  # the next sandbox of the task (a verifier's) starts clean
        refused["change the shared base checkout"] &= tree_digest(fresh) == before
    for p in (Path(f"/root/crr-probe-{h['tag']}"), Path(h["cwd"]) / f"crr-probe-{h['tag']}", base / "poison"):
        p.unlink(missing_ok=True)
    subprocess.run(["git", "-C", str(base), "checkout", "-q", "--", "."], check=True)  # where a probe got through
    return refused


@pytest.fixture(scope="module")
def refused(engine, host) -> dict[str, bool]:
    return probe_all(engine, host)  # one sandbox per engine runs every probe: a container start is ~1 s


@pytest.mark.parametrize("probe", list(PROBES))
def test_probe_is_refused(engine, refused, probe):
    assert refused[probe], f"{engine.name}: {probe} was allowed"


@pytest.mark.parametrize("engine_name", ["local", "docker"])
def test_caps_hold(host, engine_name):
    """A process tree over the memory cap is killed; writing past the disk cap fails, for the sandbox
    as a whole: three processes and three files, each under the per-process and per-file limits."""
    caps = {"fsize_limit_mb": 40, "disk_limit_mb": 64,
            **({"mem_limit_mb": 256} if engine_name == "local" else {"mem_limit": "256m"})}
    with _engine(engine_name, **caps) as eng, eng.start(host["task"]) as sb:
        hog = "python -c \"import time; b = b'x' * (110 << 20); time.sleep(4); print('held')\""
        out = sb.exec(f"for i in 1 2 3; do {hog} & done; wait", timeout=60).output
        assert out.splitlines().count("held") < 3, f"{engine_name}: three processes held 330 MB under a 256 MB cap"
        where = "/testbed" if engine_name == "local" else "/tmp"
        out = sb.exec(f"for i in 1 2 3; do head -c 30000000 /dev/zero > {where}/f$i || echo FAILED $i; done; "
                      "echo done", timeout=60).output
        assert "FAILED 3" in out and "FAILED 1" not in out, out
        assert "No space left" in out
        out = sb.exec(f"rm {where}/f*; head -c 50000000 /dev/zero > big; echo $?; stat -c %s big").output.split()
        assert out[-2:] == ["153", str(40 << 20)]  # 128 + SIGXFSZ, cut at the file-size limit


# Writes 32 KB files into {where} until {n} are written or a write fails; says why and how much it wrote.
WRITER = ("python3 -c \"import os, sys\nd, n = sys.argv[1], 0\nos.makedirs(d, exist_ok=True)\ntry:\n"
          "    for i in range(int(sys.argv[2])):\n        with open(f'{{d}}/f{{i}}', 'wb') as f:\n"
          "            f.write(b'x' * 32768)\n"
          "        n += 1\nexcept OSError as e:\n    print(e)\nprint('wrote', n >> 5, 'MB')\" {where} {n}")


@pytest.mark.parametrize("mode", ["commit", "overlay"])
def test_docker_writes_outside_tmp_and_testbed_are_capped(host, mode):
    """3x disk_limit_mb in many small files outside /tmp and /testbed (commit: the writable layer, watched;
    overlay: HOME, a scratch tmpfs of the read-only root) stops at about the cap with a bounded
    observation, and the sandbox, and the next one of the engine, work on. The overlay root refuses a
    big file anywhere else (read-only); the commit layer, full, takes deletions and no writes."""
    cap = 32
    with _engine("docker", mode=mode, disk_limit_mb=cap, fsize_limit_mb=40) as eng:
        with eng.start(host["task"]) as sb:
            where = "/opt/junk" if mode == "commit" else "/root/junk"
            res = sb.exec(WRITER.format(where=where, n=3 * cap * 32), timeout=120)
            assert "No space left on device" in res.output and len(res.output) < 1000, res.output
            held = int(sb.exec(f"du -sm {where}").output.split()[0])
            # commit: the watch overshoots by what is written between two walks of the layer, a little over 2x with
            # small files on a loaded machine (docs/sandboxes.md: 137 MB at a 64 MB cap; the suite on two workers saw
            # 68 MB here); overlay: a hard tmpfs cap
            assert cap * 0.8 <= held <= cap * (2.5 if mode == "commit" else 1), f"{mode}: {held} MB held"
            if mode == "commit":  # still over the cap: a write fails as on a full disk, and says so
                res = sb.exec("echo more > /opt/more")
                assert "File too large" in res.output and "No space left on device" in res.output, res.output
            else:
                res = sb.exec("head -c 50000000 /dev/zero > /opt/big; echo $?; ls /opt/big")
                assert "Read-only file system" in res.output and "No such file" in res.output, res.output
            assert sb.exec(f"rm -r {where}").output == ""
            assert sb.exec(f"echo ok > {where}.txt && cat {where}.txt").output == "ok\n"
            if mode == "commit":  # short actions, each under a poll interval, cannot pile up past the cap
                said = [sb.exec(f"head -c 8000000 /dev/zero > /opt/s{i}").output for i in range(6)]
                held = int(sb.exec("du -smc /opt/s* | tail -1").output.split()[0])
                assert "File too large" in said[-1] and held <= cap + 8, (held, said)
        with eng.start(host["task"]) as nxt:  # overlay: the dirty container left the pool
            out = nxt.exec(f"test -e {where}.txt || echo clean; "
                           f"find /tmp {where} -mindepth 1 2>/dev/null | wc -l").output
            assert out.split() == ["clean", "0"], out
