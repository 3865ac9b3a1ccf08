"""The sandbox, tried from the inside: every escape attempt is contained and reported."""

from __future__ import annotations

import ast
import asyncio
import ctypes
import errno
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from miles.rewards.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    _launcher,
    run_python,
)

REPO = Path(__file__).resolve().parents[3]
FAST = SandboxLimits(wall_s=3.0)
# A uid range of this test process's own, so the leftover check below cannot see other runs.
SANDBOX_UIDS = range(63000 + (os.getpid() % 400) * 16, 63000 + (os.getpid() % 400 + 1) * 16)
WORK_ROOT: Path | None = None
# As root (here and in CI) the sandbox must isolate fully: a weak fallback fails the tests. An
# unprivileged developer's run can only be weak; it is allowed, and the tests check what remains.
# The tests of a private root, pid and IPC namespace skip there: those need root, so CI (as root)
# always runs them.
ROOT = os.geteuid() == 0


def make_sandbox(
    max_concurrency: int | None = None,
    *,
    allow_weak: bool = not ROOT,
    extra_paths: tuple[str, ...] = (),
) -> Sandbox:
    return Sandbox(
        max_concurrency,
        uid_base=SANDBOX_UIDS.start,
        uid_count=len(SANDBOX_UIDS),
        workdir_root=str(WORK_ROOT),
        allow_weak=allow_weak,
        extra_paths=extra_paths,
    )


def run(
    code: str, stdin: str = "", limits: SandboxLimits = FAST, sandbox: Sandbox | None = None
) -> SandboxResult:
    async def main() -> SandboxResult:
        return await run_python(code, stdin=stdin, limits=limits, sandbox=sandbox or make_sandbox())

    return asyncio.run(main())


def processes_of(uids: range) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except (OSError, ValueError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) in uids and fields["State"].split()[0] != "Z":
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def no_stray_processes(tmp_path: Path):
    global WORK_ROOT
    WORK_ROOT = tmp_path
    yield
    assert processes_of(SANDBOX_UIDS) == [], "sandbox processes survived the run"
    assert list(tmp_path.iterdir()) == [], "work dirs left behind"


def isolated(result: SandboxResult, mechanism: str) -> bool:
    return mechanism in result.isolation


def test_runs_a_program_with_stdin() -> None:
    r = run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="2 3 4\n")
    assert (r.status, r.exit_code, r.stdout, r.contained) == ("ok", 0, "9\n", True)
    assert r.reason == "" and r.wall_s < 3.0


def test_program_errors_are_reported() -> None:
    r = run("def f():\n    return 1 / 0\nf()")
    assert r.status == "error" and r.exit_code == 1
    assert "ZeroDivisionError" in r.stderr and "ZeroDivisionError" in r.reason
    assert run("import sys; sys.exit(3)").exit_code == 3
    assert run("raise SystemExit('bye')").stderr.strip() == "bye"


def test_work_dir_is_fresh_private_and_is_home() -> None:
    r = run(
        "import os, tempfile\n"
        "open('out.txt', 'w').write('hi')\n"
        "print(os.getcwd() == os.environ['HOME'] == tempfile.gettempdir())\n"
        "print(sorted(os.listdir('.')), open('out.txt').read())"
    )
    assert r.stdout.splitlines() == ["True", "['out.txt', 'solution.py'] hi"], r.stderr


def test_infinite_loop_hits_the_wall_clock() -> None:
    start = time.monotonic()
    r = run("while True:\n    pass", limits=SandboxLimits(wall_s=1.0, cpu_s=10))
    assert r.status == "timeout" and "wall-clock" in r.reason and r.contained
    assert time.monotonic() - start < 3.0


def test_cpu_time_limit() -> None:
    r = run("while True:\n    pass", limits=SandboxLimits(wall_s=5.0, cpu_s=1))
    assert r.status == "timeout" and "CPU-time" in r.reason, (r.reason, r.stderr)
    assert r.wall_s < 5.0  # the CPU limit, not the wall clock, ended it (3.03 s on a busy host)


def test_a_sigkill_near_the_cpu_limit_is_the_limit_and_one_far_from_it_is_not() -> None:
    """The kernel's tick-counted CPU time can reach the limit before the exact time wait4 reports
    does (0.93 s of a 1 s limit on a loaded machine): that SIGKILL is still a timeout."""
    from miles.rewards.sandbox.runner import _classify, _Outcome

    limits = SandboxLimits(wall_s=5.0, cpu_s=1)
    status, reason = _classify(-9, 0.9, b"", _Outcome(), limits)
    assert (status, reason) == ("timeout", "CPU-time limit of 1s reached")
    assert _classify(-9, 0.1, b"", _Outcome(), limits)[0] == "killed"


def test_sleeping_program_is_killed_at_the_wall_clock() -> None:
    r = run("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=0.5))
    assert r.status == "timeout" and r.contained and r.wall_s < 2.0


def test_memory_hog() -> None:
    r = run("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))")
    assert r.status == "memory" and "256 MiB" in r.reason and r.contained, r.stderr[-500:]


def test_fork_bomb_is_capped_and_cleaned_up() -> None:
    # Count how many processes the program can create: the cap must stop it early.
    counting = (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n, flush=True)\n"
    )
    r = run(counting, limits=SandboxLimits(wall_s=3.0, max_processes=8))
    assert r.status == "ok" and r.contained, (r.status, r.reason, r.stderr[-500:])
    assert 1 <= int(r.stdout) < 8
    # The real thing: every child forks forever. Killed at the wall clock, nothing survives.
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    start = time.monotonic()
    r = run(bomb, limits=SandboxLimits(wall_s=1.0))
    assert r.status == "timeout" and r.contained
    assert time.monotonic() - start < 4.0


def test_daemonized_child_does_not_survive() -> None:
    # A child that leaves the process group (setsid) and outlives the program.
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    r = run(code)
    assert r.status == "ok" and r.stdout == "parent done\n" and r.contained
    # (the autouse fixture checks that no process of a sandbox uid is left)


def test_writing_outside_the_work_dir_fails() -> None:
    targets = [
        f"/tmp/miles_escape_{uuid.uuid4().hex}",
        str(REPO / f"miles_escape_{uuid.uuid4().hex}"),
        f"/dev/shm/miles_escape_{uuid.uuid4().hex}",
    ]
    code = (
        "import sys\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('escaped')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )
    r = run(code)
    try:
        assert r.status == "ok", r.stderr
        assert "WROTE" not in r.stdout, r.stdout
        assert all(not Path(t).exists() for t in targets)
    finally:
        for t in targets:
            Path(t).unlink(missing_ok=True)
    assert isolated(r, "readonly_fs") or isolated(r, "uid")


def test_file_size_and_disk_are_capped() -> None:
    code = (
        "try:\n"
        "    with open('big', 'wb') as f:\n"
        "        f.write(b'x' * (8 << 20))\n"
        "    print('wrote')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    r = run(code, limits=SandboxLimits(wall_s=3.0, file_size_mb=2, disk_mb=64))
    assert r.stdout.startswith("refused"), (r.stdout, r.stderr)
    if isolated(r, "tmpfs_workdir"):  # many files, each under the size cap, fill the disk quota
        many = "for i in range(40):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
        r = run(many, limits=SandboxLimits(wall_s=3.0, file_size_mb=2, disk_mb=8))
        assert r.status == "error" and "No space left" in r.stderr


def test_no_network() -> None:
    received: list[bytes] = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            received.append(conn.recv(1024) or b"<connected>")
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        code = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'escaped')\n"
            "print('CONNECTED')\n"
        )
        r = run(code)
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert received == [] and "CONNECTED" not in r.stdout
    assert r.status == "error" and r.contained
    assert isolated(r, "netns") or isolated(r, "socket_guard")


def test_socket_guard_fallback_refuses_inet_sockets() -> None:
    # The fallback for systems without network namespaces, exercised directly.
    code = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('launcher', {_launcher.__file__!r})\n"
        "launcher = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(launcher)\n"
        "launcher._block_sockets()\n"
        "import socket\n"
        "a, b = socket.socketpair()\n"
        "try:\n"
        "    socket.socket()\n"
        "except PermissionError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert out.stdout.startswith("refused: network access is disabled"), out.stderr


def test_huge_output_is_cut_and_killed() -> None:
    limits = SandboxLimits(wall_s=5.0, max_output_bytes=10_000)
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", limits=limits)
    assert r.status == "output_limit" and r.contained and len(r.stdout) == 10_000
    r = run("import sys\nwhile True:\n    sys.stderr.write('y' * 4096)", limits=limits)
    assert r.status == "output_limit" and len(r.stderr) == 10_000


def test_unprivileged_and_no_new_privileges() -> None:
    r = run("import os\nprint(os.getuid(), os.geteuid())\nos.setuid(0)")
    if not isolated(r, "uid"):
        # Dropping to a leased uid needs root (as here and in CI); an unprivileged developer's run
        # keeps its own uid, which this test has nothing to check against.
        pytest.skip("not running as root: no uid to drop to")
    uid, euid = map(int, r.stdout.split())
    assert uid == euid and uid in SANDBOX_UIDS
    assert r.status == "error" and "PermissionError" in r.stderr


def test_concurrency_is_bounded() -> None:
    async def main() -> list[SandboxResult]:
        sandbox = make_sandbox(max_concurrency=2)
        code = "import time\ntime.sleep(0.3)"
        return await asyncio.gather(*(run_python(code, sandbox=sandbox) for _ in range(4)))

    start = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - start
    assert all(r.ok for r in results)
    assert elapsed >= 0.6  # two waves of two


def test_limits_validation() -> None:
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)
    assert SandboxLimits(wall_s=2.5).cpu_seconds == 3


# Reward hacking by reading the host: answers, test cases, other runs' outputs, configs.


def test_host_files_do_not_exist_inside() -> None:
    if not ROOT:
        pytest.skip("not running as root: no private root file system")
    assert WORK_ROOT is not None
    secret = f"miles-secret-{uuid.uuid4().hex}"
    planted = [
        Path(f"/tmp/miles_secret_{uuid.uuid4().hex}"),  # world-readable, in the shared /tmp
        REPO / f"miles_secret_{uuid.uuid4().hex}",  # the repository
        WORK_ROOT / f"miles_secret_{uuid.uuid4().hex}",  # the work dir's parent
    ]
    code = (
        "import os\n"
        f"for path in {[str(p) for p in planted]!r} + ['/etc/passwd', '/etc/hostname']:\n"
        "    try:\n"
        "        print('READ', path, open(path).read())\n"
        "    except OSError as e:\n"
        "        print('hidden', e.errno)\n"
        "parent = os.path.dirname(os.getcwd())\n"
        "print('parent', sorted(os.listdir(parent)) == [os.path.basename(os.getcwd())])\n"
        "for path in ['/home', '/sys', '/var', '/run', '/opt', '/etc/hosts']:\n"
        "    print('exists', path, os.path.exists(path))\n"
        "print('etc', sorted(os.listdir('/etc')))\n"
        f"repo = {str(REPO)!r}\n"
        "print('repo', sorted(os.listdir(repo)) if os.path.exists(repo) else None)\n"
    )
    try:
        for path in planted:
            path.write_text(secret)
            path.chmod(0o644)
        r = run(code)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
    assert r.status == "ok", r.stderr
    assert secret not in r.stdout and "READ" not in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    assert lines.count("hidden 2") == len(planted) + 2  # ENOENT: not there at all
    assert "parent True" in lines and "etc ['ld.so.cache']" in lines
    assert not [line for line in lines if line.startswith("exists") and line.endswith("True")]
    # The repository exists inside only as the way to an interpreter directory in it (a venv).
    venvs = {
        Path(d).relative_to(REPO).parts[0]
        for d in make_sandbox()._interpreter_dirs()
        if Path(d).is_relative_to(REPO)
    }
    repo_line = next(line for line in lines if line.startswith("repo"))
    assert repo_line == ("repo None" if not venvs else f"repo {sorted(venvs)}"), repo_line
    assert isolated(r, "private_root") and isolated(r, "mountns")


def test_host_processes_are_not_visible() -> None:
    if not ROOT:
        pytest.skip("not running as root: no pid namespace")
    host_init = Path("/proc/1/cmdline").read_bytes()
    code = (
        "import os, json\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "init = open('/proc/1/cmdline', 'rb').read()\n"
        "try:\n"
        f"    os.kill({os.getpid()}, 0)\n"
        "    signal = 'delivered'\n"
        "except OSError as e:\n"
        "    signal = type(e).__name__\n"
        "print(json.dumps({'pids': pids, 'init': init.decode(), 'me': os.getpid(),\n"
        "                  'parent': os.getppid(), 'signal': signal}))\n"
    )
    r = run(code)
    assert r.status == "ok", r.stderr
    seen = json.loads(r.stdout)
    # pid 1 is the sandbox's init, 2 the program: nothing of the host, whose pid 1 stays unread.
    assert seen["pids"] == [1, 2] and (seen["me"], seen["parent"]) == (2, 1), seen
    assert "_launcher.py" in seen["init"] and seen["init"].encode() != host_init
    if os.getpid() > 2:  # the test's own pid names no process inside
        assert seen["signal"] == "ProcessLookupError"
    assert isolated(r, "pidns") and isolated(r, "private_proc")


def test_host_ipc_is_not_visible() -> None:
    # A world-readable System V shared memory segment of the host: a channel around the file system.
    if not ROOT:
        pytest.skip("not running as root: no IPC namespace")
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x4D000000 + os.getpid() % 0xFFFF
    shmid = libc.shmget(key, 4096, 0o1000 | 0o644)  # IPC_CREAT, rw-r--r--
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        code = (
            "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({key}, 0, 0), ctypes.get_errno())\n"
        )
        r = run(code)
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    assert r.status == "ok", r.stderr
    assert r.stdout.split() == ["-1", "2"]  # ENOENT: no such segment in the sandbox
    assert isolated(r, "ipcns")


def test_no_sys_and_a_minimal_dev() -> None:
    if not ROOT:
        pytest.skip("not running as root: no private root file system")
    code = (
        "import os\n"
        "print(os.path.exists('/sys'), sorted(os.listdir('/dev')))\n"
        "open('/dev/null', 'w').write('x')\n"
        "print(len(open('/dev/urandom', 'rb').read(16)), open('/dev/zero', 'rb').read(2))\n"
        "for path in ('/dev/shm/x', '/dev/x', '/x'):\n"
        "    try:\n"
        "        open(path, 'w')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )
    r = run(code)
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    nodes = ["fd", "full", "null", "random", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert lines[0] == f"False {nodes}"
    assert lines[1] == "16 b'\\x00\\x00'"
    assert "WROTE" not in r.stdout, r.stdout


def test_stdlib_and_c_extensions_work_inside() -> None:
    wanted = ["json", "_json", "math", "decimal", "hashlib", "zlib", "ctypes", "unicodedata"]
    wanted += ["sqlite3", "ssl", "lzma", "bz2", "array", "heapq", "fractions", "re"]
    modules = [m for m in wanted if importlib.util.find_spec(m) is not None]
    code = (
        "import importlib, subprocess, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "import decimal, json, math\n"
        "print(json.dumps([math.isqrt(10**20), str(decimal.Decimal(1) / 7)]))\n"
        "child = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True)\n"
        "print(child.stdout.decode().strip(), child.stderr.decode()[-300:])\n"
    )
    r = run(code)
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines()[:2] == ['[10000000000, "0.1428571428571428571428571429"]', "42 "]


def test_weak_isolation_is_refused_unless_allowed() -> None:
    # A system without namespaces, simulated: the launcher treats these steps as refused.
    sandbox = make_sandbox(allow_weak=False)
    sandbox._unavailable = ("netns", "pidns", "mountns")
    with pytest.raises(SandboxUnavailable, match="allow_weak: true") as refused:
        run("print('RAN')", sandbox=sandbox)
    assert "a network namespace" in str(refused.value) and "a pid namespace" in str(refused.value)
    # One missing step is enough to refuse.
    sandbox._unavailable = ("private_root",)
    with pytest.raises(SandboxUnavailable, match="private root"):
        run("print('RAN')", sandbox=sandbox)
    if not ROOT:
        return
    # Allowed: it runs, with what remains, and says which mechanisms those are.
    weak = make_sandbox(allow_weak=True)
    weak._unavailable = ("netns", "pidns", "private_root")
    r = run("print('RAN')", sandbox=weak)
    assert r.ok and r.stdout == "RAN\n", r.stderr
    assert isolated(r, "socket_guard") and isolated(r, "readonly_fs") and isolated(r, "uid")
    assert not any(isolated(r, m) for m in ("netns", "pidns", "private_root", "private_proc"))


def test_extra_paths_are_shown_read_only(tmp_path_factory: pytest.TempPathFactory) -> None:
    if not ROOT:
        pytest.skip("not running as root: no private root file system")
    data = tmp_path_factory.mktemp("extra")
    (data / "table.txt").write_text("42")
    data.chmod(0o755)  # the program's uid needs read access; closed parents do not matter
    code = (
        f"print(open({str(data / 'table.txt')!r}).read())\nopen({str(data / 'new.txt')!r}, 'w')\n"
    )
    r = run(code, sandbox=make_sandbox(extra_paths=(str(data),)))
    assert r.stdout == "42\n" and "Read-only file system" in r.stderr, r.stderr
    assert not (data / "new.txt").exists()


def test_the_parent_environment_does_not_reach_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    # A secret in the parent's environment (an API key, a token): the program sees none of it,
    # not in os.environ, not in its process's initial environment block (the argv and environment
    # strings at the top of its stack, which clearing os.environ leaves in place; read here from
    # memory, between argv[0] and the executable's name, as /proc/self/environ would show them),
    # not in its parent's environment.
    secret = f"miles-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("MILES_TEST_SECRET", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    code = (
        "import ctypes, os\n"
        "print(sorted(os.environ.items()))\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.getauxval.restype = ctypes.c_ulong\n"
        "start = ctypes.c_void_p.in_dll(libc, 'program_invocation_name').value\n"
        "block = ctypes.string_at(start, libc.getauxval(31) - start)  # AT_EXECFN\n"
        "print('stack', block)\n"
        "for path in ('/proc/self/environ', f'/proc/{os.getppid()}/environ'):\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(path, 'unreadable', e.errno)\n"
    )
    r = run(code)
    assert r.status == "ok", r.stderr
    assert secret not in r.stdout and secret not in r.stderr, r.stdout
    assert "PATH=" in r.stdout.splitlines()[1], r.stdout  # the block was read
    # What the program gets is the sandbox's own short environment, and nothing else.
    names = {k for k, _ in ast.literal_eval(r.stdout.splitlines()[0])}
    assert names <= {"HOME", "TMPDIR", "PATH", "LANG", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                     "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}, names  # fmt: skip


def test_unix_sockets_of_the_host_are_out_of_reach() -> None:
    # A host service on a Unix socket (a docker or database socket, say), on a world-writable
    # path and on the abstract namespace: connecting is a way out that file modes do not stop.
    sock_dir = Path(f"/tmp/miles_sock_{uuid.uuid4().hex[:12]}")
    sock_dir.mkdir(mode=0o777)
    sock_dir.chmod(0o777)
    path = str(sock_dir / "host.sock")
    abstract = f"\0miles-host-{uuid.uuid4().hex}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen()
        server.settimeout(0.2)
        servers.append(server)
    os.chmod(path, 0o777)
    received: list[bytes] = []
    stop = threading.Event()

    def accept(server: socket.socket) -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            received.append(conn.recv(1024) or b"<connected>")
            conn.close()

    threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        code = (
            "import socket\n"
            f"for address in ({path!r}, {abstract!r}):\n"
            "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "    try:\n"
            "        s.connect(address)\n"
            "        s.sendall(b'escaped')\n"
            "        print('CONNECTED', repr(address))\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n"
        )
        r = run(code)
        time.sleep(0.3)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for server in servers:
            server.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert r.status == "ok", r.stderr
    if not ROOT:  # no network namespace: the abstract socket is reachable, as docs/sandbox.md says
        pytest.skip("not running as root: no network namespace or private root")
    assert received == [] and "CONNECTED" not in r.stdout, r.stdout
    assert r.stdout.split() == ["refused", "2", "refused", "111"]  # ENOENT, ECONNREFUSED


def test_the_program_cannot_forge_the_launchers_report() -> None:
    # `init` reports how the program ended on a pipe the program must not reach. A forger writes
    # a clean exit to every descriptor it has or can open (its own, init's and the launcher's via
    # /proc) and leaves a half line that would swallow the real report; then it fails.
    forged = b'{"end": {"exit_code": 0, "cpu_s": 0.0}}\n{"ready": true}\n{"swallow": "'
    code = (
        "import os, time\n"
        "time.sleep(0.3)  # after init's setup line: the real report comes next\n"
        f"forged = {forged!r}\n"
        "hits = []\n"
        "for fd in range(3, 256):\n"
        "    try:\n"
        "        os.write(fd, forged)\n"
        "        hits.append(fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "for pid in (1, os.getppid()):  # init (the launcher's child), or the host's init\n"
        "    try:\n"
        "        fds = os.listdir(f'/proc/{pid}/fd')\n"
        "    except OSError:\n"
        "        continue\n"
        "    for fd in fds:\n"
        "        try:\n"
        "            w = os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)\n"
        "            os.write(w, forged)\n"
        "            hits.append(f'{pid}/{fd}')\n"
        "        except OSError:\n"
        "            pass\n"
        "print('wrote to', hits, flush=True)\n"
        "os._exit(7)\n"
    )
    r = run(code)
    assert (r.status, r.exit_code) == ("error", 7), (r.stdout, r.stderr)
    assert r.reason.startswith("exit code 7") and r.contained


# -- the audit's probes of memory and state (each passed on the old sandbox) ------------------

SHM_HOG = """
import ctypes
import errno
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
for _ in range(6):
    sid = libc.shmget(0, 128 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    if sid < 0:
        print("refused", ctypes.get_errno(), flush=True)
        break
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 1, 128 << 20)  # bring every page in
    libc.shmdt(ctypes.c_void_p(addr))  # unmapped: out of RLIMIT_AS's sight, the pages stay
    if libc.shmctl(sid, 2, ctypes.create_string_buffer(512)) < 0:  # IPC_STAT: still there?
        print("gone", ctypes.get_errno(), flush=True)
        continue
    held += 128
    print("held", held, flush=True)
"""

MEMFD_HOG = """
import os
held = 0
files = []
for _ in range(20):
    fd = os.memfd_create("x")
    files.append(fd)
    for _ in range(15):
        os.write(fd, bytes(1 << 20))  # written, never mapped: not in the address space
    held += 15
    print("held", held, flush=True)
"""


def _held(stdout: str) -> int:
    return max(
        [0, *(int(line.split()[1]) for line in stdout.splitlines() if line.startswith("held"))]
    )


@pytest.mark.skipif(not ROOT, reason="the IPC namespace and its sysctls need root")
def test_sysv_shared_memory_counts_against_the_limit() -> None:
    """The audit: 6 x 128 MiB of SysV shared memory with memory_mb=256."""
    r = run(SHM_HOG, limits=SandboxLimits(wall_s=10.0, memory_mb=256))
    assert _held(r.stdout) <= 256, (r.stdout, r.reason)
    assert isolated(r, "ipc_capped") and r.contained


@pytest.mark.skipif(not ROOT, reason="a memory cgroup and seccomp need root")
@pytest.mark.parametrize("cgroup", [True, False], ids=["machine-cgroup", "no-cgroup"])
def test_memfd_pages_count_against_the_limit(cgroup: bool) -> None:
    """The audit: 20 x 15 MiB of memfd pages with memory_mb=64. With a memory cgroup they are
    charged to the run (and the kernel stops it); without one, memfd_create is refused."""
    sandbox = make_sandbox()
    if not cgroup:
        sandbox._unavailable = ("memory_cgroup",)
    r = run(MEMFD_HOG, limits=SandboxLimits(wall_s=10.0, memory_mb=64), sandbox=sandbox)
    assert _held(r.stdout) <= 64, (r.stdout, r.reason)
    if any(m.startswith("memory_cgroup_v") for m in r.isolation):
        assert r.status == "memory" and "memory cgroup" in r.reason, (r.status, r.reason)
    else:
        assert r.status == "error" and "Operation not permitted" in r.stderr, r.stderr[-500:]
    assert r.contained


KEYRING = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
USER_KEYRING, KEYCTL_SEARCH = -4, 10
if sys.stdin.read() == "write":
    r = libc.syscall(add_key, b"user", b"miles-probe", b"secret", 6, USER_KEYRING)
else:
    r = libc.syscall(keyctl, KEYCTL_SEARCH, USER_KEYRING, b"user", b"miles-probe", 0)
print(r, ctypes.get_errno())
"""


@pytest.mark.skipif(not ROOT, reason="seccomp and a uid of its own need root")
def test_no_keyring_state_survives_from_one_sample_to_the_next() -> None:
    """The audit: sample 1's `add_key @u` was read by sample 2, run as the same uid."""
    sandbox = make_sandbox(max_concurrency=1)
    written = run(KEYRING, stdin="write", sandbox=sandbox)
    read = run(KEYRING, stdin="read", sandbox=sandbox)
    assert written.stdout.split() == ["-1", str(errno.EPERM)], written.stdout + written.stderr
    assert read.stdout.split()[0] == "-1", read.stdout  # nothing found, nothing readable
    assert isolated(written, "seccomp")


@pytest.mark.skipif(not ROOT, reason="seccomp needs root here (no_new_privs comes with the uid)")
def test_no_user_namespaces_and_threads_and_subprocesses_still_work() -> None:
    """The audit: `unshare(CLONE_NEWUSER)` succeeded inside. Threads (clone3 refused, so libc
    falls back to clone) and subprocesses must keep working."""
    code = """
import ctypes, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
print("unshare", libc.unshare(0x10000000), ctypes.get_errno())
box = []
thread = threading.Thread(target=box.append, args=(1,))
thread.start(); thread.join()
print("thread", box)
print("child", subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout.strip())
"""
    r = run(code, limits=SandboxLimits(wall_s=10.0))
    assert r.ok, r.stderr[-800:]
    assert r.stdout.splitlines() == ["unshare -1 1", "thread [1]", "child 7"], r.stdout


@pytest.mark.skipif(not ROOT, reason="a pid namespace of its own needs root")
def test_the_launchers_config_is_not_readable_inside() -> None:
    """The audit: /proc/1/cmdline (the sandbox's init) showed the launcher's config."""
    r = run("print(open('/proc/1/cmdline', 'rb').read().replace(b'\\0', b' ').decode())")
    assert r.ok, r.stderr[-500:]
    assert "_launcher.py" in r.stdout  # the right process...
    assert "memory_bytes" not in r.stdout and "workdir" not in r.stdout  # ...without its config
