"""Worker processes that take turns: each runs a block of training steps while the others wait, in rotating order.

The GPU machine's speed drifts by 10-25% over seconds to a minute (bench/interference_probe.py), more than the
differences the swap benchmark measures. Runs of one side after another, even in rotating rounds, put that drift
between the sides. In lockstep every side's process is alive at once and holds its model on the device; the conductor
(the parent) lets one of them run `block` steps, then the next, so the sides' timed steps interleave a few seconds
apart and see the same machine. Only one process has work on the device or a busy launching thread at any time.

The protocol: two pipes per worker, whose ends the worker inherits (pass_fds). The worker writes a line when it
reaches a pause ("built" after its setup, "ready" after a block of steps) and waits for "go". A worker that exits
closes its end: the conductor reads end-of-file and learns that it finished (after its last block) or failed.

    conductor = Conductor(log=print)
    conductor.start(name, cmd, env=..., cwd=...)       # each side; spec files tell the workers their fds
    conductor.run(cycles, timeout_s=...)                 # builds, warm-ups one at a time, then the cycles

Worker side: `Gate.from_spec(spec["lockstep"])`, then `gate.pause("built")` before the first step and
`gate.pause("ready")` after each block but the last (`Gate.pauses_after(step, warmup, block, steps)`).
"""

import collections
import os
import select
import signal
import subprocess
import threading
import time


class Gate:
    """The worker's end: announce a pause, then wait for the conductor's "go"."""

    def __init__(self, go_fd, ready_fd):
        self.go_fd = go_fd
        self.ready_fd = ready_fd
        self.buffer = b""
        self.pauses = 0
        self.spans = []        # [start, end] of each turn, CLOCK_MONOTONIC seconds (the same clock in every process)
        self.resumed = None

    @classmethod
    def from_spec(cls, spec):
        return cls(int(spec["go_fd"]), int(spec["ready_fd"])) if spec else None

    @staticmethod
    def pauses_after(step, warmup, block, steps):
        """Whether the worker pauses after step `step` (0-based): at the end of the warm-up, then after every
        `block` timed steps, never after the last step (the worker then finishes and exits)."""
        if step >= steps - 1 or step < warmup - 1:
            return False
        return (step - (warmup - 1)) % block == 0

    def pause(self, what):
        self.end_turn()
        os.write(self.ready_fd, (what + "\n").encode())
        while b"\n" not in self.buffer:
            chunk = os.read(self.go_fd, 64)
            if not chunk:
                raise SystemExit(f"lockstep: the conductor closed the pipe while this worker waited after {what!r}")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        if line.strip() != b"go":
            raise SystemExit(f"lockstep: expected 'go' from the conductor, got {line!r}")
        self.pauses += 1
        self.resumed = time.monotonic()

    def end_turn(self):
        """Closes the current turn's span (pause calls it; the worker calls it once after its last step)."""
        if self.resumed is not None:
            self.spans.append([self.resumed, time.monotonic()])
            self.resumed = None


def overlaps(spans_by_member):
    """How many turns began before another member's turn had ended: 0 when the members really took turns."""
    spans = sorted((a, b, name) for name, spans in spans_by_member.items() for a, b in spans)
    count, last_end, last_name = 0, None, None
    for a, b, name in spans:
        if last_end is not None and a < last_end and name != last_name:
            count += 1
        if last_end is None or b > last_end:
            last_end, last_name = b, name
    return count


class Member:
    """The conductor's end of one worker process."""

    def __init__(self, name, proc, go_w, ready_r, log):
        self.name = name
        self.proc = proc
        self.go_w = go_w
        self.ready_r = ready_r
        self.buffer = b""
        self.done = False       # exited (after its last block, or failed)
        self.error = None       # why the conductor gave up on it
        self.turns = 0          # blocks of timed steps it was let run
        self.tail = collections.deque(maxlen=30)
        self.reader = threading.Thread(target=self._pump, args=(log,), daemon=True)
        self.reader.start()

    def _pump(self, log):
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            log(f"   {line.rstrip()}")

    def go(self):
        try:
            os.write(self.go_w, b"go\n")
        except OSError:  # it exited already: the wait that follows reads end-of-file
            pass

    def wait(self, timeout_s):
        """The worker's next message ("built", "ready"), or None when it exited; raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no word from the worker in {timeout_s:.0f} s")
            readable, _, _ = select.select([self.ready_r], [], [], left)
            if not readable:
                continue
            chunk = os.read(self.ready_r, 64)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode().strip()

    def finish(self, timeout_s):
        """Waits for the process to exit (killing its process group past the timeout); returns its status."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.wait()
            self.error = self.error or f"did not exit within {timeout_s:.0f} s of its last block"
        self.reader.join(timeout=5)
        for fd in (self.go_w, self.ready_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.done = True
        return rc

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Conductor:
    """Starts workers and lets them take turns. `log` prints the workers' output and the conductor's notes."""

    def __init__(self, log=print):
        self.log = log
        self.members = []

    def start(self, name, cmd_for, env=None, cwd=None):
        """Starts one worker. `cmd_for(lockstep)` gives its command line, given the {"go_fd", "ready_fd"} it must
        pass on to the worker (bench/swap.py writes them into the worker's spec file)."""
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        cmd = cmd_for({"go_fd": go_r, "ready_fd": ready_w})
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True, pass_fds=(go_r, ready_w))
        os.close(go_r)
        os.close(ready_w)
        m = Member(name, proc, go_w, ready_r, self.log)
        self.members.append(m)
        return m

    @staticmethod
    def _word(m, timeout_s):
        """m's next word, None when it exited; past the timeout it is killed, done, and None."""
        try:
            return m.wait(timeout_s)
        except TimeoutError as e:
            m.error = str(e)
            m.kill()
            m.finish(10)
            return None

    def _expect(self, m, want, timeout_s):
        """Waits for `want` from `m`; on anything else (exit, timeout, another word) the member is done."""
        got = self._word(m, timeout_s)
        if m.done:
            return False
        if got == want:
            return True
        if got is not None:
            m.error = f"said {got!r} where {want!r} was expected"
            m.kill()
        m.finish(timeout_s)
        if got is None and m.error is None:
            m.error = f"exited before saying {want!r} (status {m.proc.returncode})"
        return False

    def settle(self, members, timeout_s, on_failure=None):
        """Waits for each member's "built" (they build at once), then lets each run its warm-up alone, in order.
        A member that fails there is passed to on_failure, which may return a replacement member (started), which
        is settled in turn. Returns the members ready for the cycles."""
        ready = []
        queue = list(members)
        while queue:
            built = [m for m in queue if self._expect(m, "built", timeout_s)]
            failed = [m for m in queue if m not in built]
            queue = []
            for m in built:
                m.go()
                if self._expect(m, "ready", timeout_s):
                    ready.append(m)
                else:
                    failed.append(m)
            for m in failed:
                self.log(f"== lockstep: {m.name} failed before its timed steps: {m.error}")
                replacement = on_failure(m) if on_failure else None
                if replacement is not None:
                    queue.append(replacement)
        return ready

    def cycle(self, members, cycles, timeout_s):
        """`cycles` rounds in which each member runs one block; the order rotates by one each round. A member's
        last block ends with its exit. Returns the order of turns [(cycle, name)]."""
        order = []
        live = list(members)
        for k in range(cycles):
            shift = k % len(live) if live else 0
            for m in live[shift:] + live[:shift]:
                if m.done:
                    continue
                m.go()
                m.turns += 1
                order.append((k, m.name))
                if k == cycles - 1:  # its last block: it finishes and exits
                    got = self._last(m, timeout_s)
                    if got is not None:
                        m.error = m.error or f"said {got!r} after its last block"
                        m.kill()
                        m.finish(10)
                elif not self._expect(m, "ready", timeout_s):
                    self.log(f"== lockstep: {m.name} failed in cycle {k + 1}: {m.error}")
            live = [m for m in live if not m.done]
        return order

    def _last(self, m, timeout_s):
        got = self._word(m, timeout_s)
        if got is None and not m.done:
            m.finish(timeout_s)
        return got

    def close(self):
        """Kills whatever is still running (a conductor cut short) and closes the pipes."""
        for m in self.members:
            if not m.done:
                m.kill()
                m.finish(10)


# A worker for self_test: "built", `warmup` steps, then blocks of `block` steps (each a short sleep), its turns'
# spans written to `out` at the end; `fail_at` (a step) makes it exit with status 3 there.
_SELF_TEST_WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import lockstep
go_fd, ready_fd, warmup, block, steps, fail_at, out = sys.argv[2:]
warmup, block, steps, fail_at = int(warmup), int(block), int(steps), int(fail_at)
gate = lockstep.Gate(int(go_fd), int(ready_fd))
gate.pause("built")
for step in range(steps):
    if step == fail_at:
        sys.exit(3)
    time.sleep(0.005)
    if lockstep.Gate.pauses_after(step, warmup, block, steps):
        gate.pause("ready")
gate.end_turn()
open(out, "w").write(json.dumps(gate.spans))
"""


def self_test():
    """Real processes (no torch): they take turns without overlapping, in rotating order; one that fails before
    its timed steps is replaced when on_failure says so, one that fails in a cycle drops out. Returns the number of
    checks."""
    import json
    import pathlib
    import sys
    import tempfile

    here = str(pathlib.Path(__file__).resolve().parent)
    warmup, block, cycles = 2, 3, 3
    steps = warmup + cycles * block
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        conductor = Conductor(log=notes.append)

        def start(name, fail_at=-1):
            out = f"{tmp}/{name}.json"
            return conductor.start(name, lambda fds: [sys.executable, "-c", _SELF_TEST_WORKER, here,
                                                      str(fds["go_fd"]), str(fds["ready_fd"]), str(warmup),
                                                      str(block), str(steps), str(fail_at), out])

        members = [start("a"), start("b"), start("c", fail_at=1), start("d", fail_at=warmup + block + 1)]
        replaced = []

        def on_failure(m):
            replaced.append(m.name)
            return start("c2") if m.name == "c" else None

        try:
            ready = conductor.settle(members, 30, on_failure)
            order = conductor.cycle(ready, cycles, 30)
        finally:
            conductor.close()
        names = [m.name for m in ready]
        assert names == ["a", "b", "d", "c2"] and replaced == ["c"], (names, replaced)
        assert order[:4] == [(0, "a"), (0, "b"), (0, "d"), (0, "c2")], order
        assert [n for k, n in order if k == 1] == ["b", "d", "c2", "a"], order  # rotated by one; d fails in it
        assert [n for k, n in order if k == 2] == ["c2", "a", "b"], order      # d is gone
        d = next(m for m in conductor.members if m.name == "d")
        assert d.error and d.proc.returncode == 3, (d.error, d.proc.returncode)
        spans = {n: json.loads(pathlib.Path(f"{tmp}/{n}.json").read_text()) for n in ("a", "b", "c2")}
        assert all(len(s) == 1 + cycles for s in spans.values()), spans  # the warm-up and one turn per cycle
        assert overlaps(spans) == 0, spans
        assert overlaps({"x": [[0.0, 2.0]], "y": [[1.0, 3.0]]}) == 1 and overlaps({"x": [[0, 1], [2, 3]],
                                                                                  "y": [[1, 2]]}) == 0
        assert all(m.done for m in conductor.members)
    return 9
