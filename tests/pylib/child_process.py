"""Child processes for kvr's Python tests and scripts (standard library only): stopping one
(SIGTERM, then SIGKILL), and a child whose stdout lines a thread collects so that a test can
wait for the line a kvr process prints once it listens or is ready.

Scripts outside this folder put it on sys.path themselves (os.path of their own __file__)."""
import re
import subprocess
import tempfile
import threading
import time


def stop(proc, timeout):
    """Ends `proc` (a subprocess.Popen) and reaps it: SIGTERM, then SIGKILL when it has not
    exited `timeout` seconds later. Nothing to do when it has already exited."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Process:
    """A child process whose stdout lines a thread collects (`lines`, without newlines). Its
    stderr goes to a temporary file named after `log_name` (kept, and named in errors) when
    one is given, else into stdout with the rest. `env`: its environment (default: this
    process's). `stop_timeout`: the seconds stop() waits after SIGTERM."""

    def __init__(self, argv, log_name=None, env=None, stop_timeout=5.0):
        self.argv = argv
        self.stop_timeout = stop_timeout
        self.log = None
        stderr = subprocess.STDOUT
        if log_name is not None:
            self.log = tempfile.NamedTemporaryFile("w+", prefix=log_name + "-", suffix=".log",
                                                   delete=False)
            stderr = self.log
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env=env)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def _wait(self, find, what, timeout):
        """The first non-None find(line) over the lines so far and those to come; RuntimeError
        naming `what` when `timeout` seconds pass or the process exits first."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                for line in self.lines:
                    found = find(line)
                    if found is not None:
                        return found
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    where = (f"stderr in {self.log.name}" if self.log is not None else
                             "output:\n" + "\n".join(self.lines))
                    raise RuntimeError(f"{self.argv[0]}: no line {what} "
                                       f"(exit {self.proc.poll()}); {where}")
                self.cv.wait(min(left, 0.2))

    def wait_for(self, prefix, timeout=20.0):
        """The first stdout line starting with `prefix`; RuntimeError on timeout or exit."""
        return self._wait(lambda line: line if line.startswith(prefix) else None,
                          f"starting with {prefix!r}", timeout)

    def wait_match(self, pattern, timeout=20.0):
        """The re.Match of the first stdout line that `pattern` matches (re.search);
        RuntimeError on timeout or exit."""
        regex = re.compile(pattern)
        return self._wait(regex.search, f"matching {pattern!r}", timeout)

    def stop(self):
        """Stops the process; closes its stdout once the reader has seen the end of it (a
        grandchild that kept the pipe open leaves it to the garbage collector)."""
        stop(self.proc, self.stop_timeout)
        self.reader.join(timeout=1.0)
        if not self.reader.is_alive():
            self.proc.stdout.close()
