"""The documentation's examples, run as written: every shell command and Python snippet of the
README and of the docs' pages and guides, on the tests' tiny model.

A page's examples run in order, in one folder of its own holding the files they name (written
below, or by a block of the page marked as that file), so a later example sees what an earlier
one wrote and a server an example starts answers the examples after it. Two things are the
test's, not the page's:

- `$LLAMABATCH_CATALOG` names a catalog whose `gemma3-270m` (the default model) is the tiny
  model, so `llamabatch run -p ...` and `BatchEngine(n_parallel=8)` run as printed;
- ports: a page's `--port 8000` and `127.0.0.1:8000` become a free port (the same one on the
  whole page), and `llamabatch serve` without `--port` gets that page's port for 8000.

A `llamabatch serve` line runs in the background, as in a second terminal, and the next line
waits for its `/health`; everything a page started is stopped when the page is done.

A block that cannot run here says so in an HTML comment on the line before it, which neither
GitHub nor the site shows; directives are separated by ";":

    <!-- example: skip: REASON -->              not run (a remote host, a GPU, a download)
    <!-- example: omit 'TEXT': REASON -->       lines containing TEXT are not run
    <!-- example: replace 'OLD' 'NEW' -->       run with OLD replaced (a smaller size)
    <!-- example: file NAME -->                 a JSON/TOML/text block written as the file NAME
"""

from __future__ import annotations

import html.parser
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tiny_model import write_tiny_audio_projector, write_tiny_lora, write_tiny_model, write_tiny_projector

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "guides").glob("*.md"))]
RUNNABLE = {"bash": "bash", "sh": "bash", "python": "python"}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!-- example: (?P<directives>.*) -->\s*$")
PORT = re.compile(r"(?P<lead>127\.0\.0\.1:|localhost:|--port )(?P<port>\d{4,5})\b")
SERVE = re.compile(r"^\s*llamabatch serve\b")
DEFAULT_PORT = 8000  # serve's
EXAMPLE_TIMEOUT_S = 600


@dataclass
class Example:
    page: str
    line: int
    lang: str
    text: str
    skip: str | None = None
    file: str | None = None
    omit: list[str] = field(default_factory=list)
    replace: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def examples(page: Path) -> list[Example]:
    """The page's fenced blocks (indented ones inside lists too), with their markers."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence or not fence["lang"]:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = len(fence["indent"])
        example = Example(page.relative_to(ROOT).as_posix(), i + 1, fence["lang"], "\n".join(l[indent:] for l in lines[i + 1:end]) + "\n")
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            _apply(example, marker["directives"])
        found.append(example)
        i = end + 1
    return found


def _apply(example: Example, directives: str) -> None:
    for directive in (d.strip() for d in directives.split(";")):
        verb, _, rest = directive.partition(" ")
        if verb == "skip:":
            example.skip = rest.strip()
        elif verb == "file":
            example.file = rest.strip()
        elif verb == "omit":
            text, reason = rest.split(":", 1)
            assert reason.strip(), f"{example.where}: omit needs a reason"
            example.omit.append(shlex.split(text)[0])
        elif verb == "replace":
            old, new = shlex.split(rest)
            assert old in example.text, f"{example.where}: replace: {old!r} is not in the block"
            example.replace.append((old, new))
        else:
            raise AssertionError(f"{example.where}: unknown example directive {directive!r}")


def test_every_block_runs_or_says_why():
    """A runnable block has no marker or a known one; a skip has a reason; a marked file is a data
    block; a marker stands right above the block it is for."""
    for page in PAGES:
        lines = page.read_text().split("\n")
        for n, line in enumerate(lines[:-1], 1):
            assert not MARKER.match(line) or FENCE.match(lines[n]), f"{page.name}:{n}: a marker with no block under it"
        for example in examples(page):
            assert example.skip != "", f"{example.where}: a skip needs its reason"
            if example.file:
                assert example.lang not in RUNNABLE, f"{example.where}: a {example.lang} block is run, not written"


def test_the_built_site_loads_nothing_from_the_network(tmp_path):
    """The site reads offline: no script, stylesheet or font from a CDN (mermaid would load its
    script from one, so the diagrams are drawn in text; the theme uses the system's fonts)."""
    pytest.importorskip("mkdocs")
    for page in PAGES:
        assert "```mermaid" not in page.read_text(), f"{page}: a mermaid diagram needs a script from the network"
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    pages = list(site.rglob("*.html"))
    assert len(pages) > 20
    remote = {m[0] for page in pages for m in re.finditer(r'<(?:script|link)\b[^>]*\b(?:src|href)="((?:https?:)?//[^"]*)"', page.read_text())}
    assert not remote, f"the site loads these from the network: {sorted(remote)}"


# The input files the pages' examples read: the docs ship them (docs/examples), as a reader gets them.
EXAMPLES = ROOT / "docs" / "examples"


def write_files(work: Path) -> None:
    """The pages' input files, and tiny stand-ins for the models and adapters a reader brings."""
    for path in EXAMPLES.iterdir():
        shutil.copy(path, work / path.name)
    write_tiny_model(work / "tiny.gguf", n_ctx_train=8192)
    write_tiny_model(work / "small.gguf", n_ctx_train=8192, seed=3)  # a draft model: the same vocabulary
    write_tiny_model(work / "my-reranker.gguf", rank_head=True)
    write_tiny_projector(work / "mmproj.gguf")
    write_tiny_audio_projector(work / "tiny-audio-mmproj.gguf")
    write_tiny_model(work / "coder.gguf", fim=True)
    for name in ("house-style", "terse", "a", "b"):
        write_tiny_lora(work / f"{name}.gguf")
    (work / "models.toml").write_text(
        'default = "gemma3-270m"\n\n[models.gemma3-270m]\npath = "tiny.gguf"\nn_ctx = 4096\nparallel = 4\nthreads = 2\n'
        'chat_template = "gemma"\n\n[models.gemma3-270m.adapters]\nterse = "terse.gguf"\n'
    )


class Page:
    """One page's folder, environment, ports and background processes."""

    def __init__(self, work: Path):
        self.work = work
        self.ports: dict[str, int] = {}
        self.servers: dict[int, subprocess.Popen] = {}
        self.groups: list[int] = []
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "LLAMABATCH_CATALOG": str(work / "models.toml"), "XDG_DATA_HOME": str(work), "PATH": f"{bin_dir}:{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def port(self, original: str) -> int:
        if original not in self.ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.ports[original] = s.getsockname()[1]
        return self.ports[original]

    def localize(self, text: str) -> str:
        return PORT.sub(lambda m: f"{m['lead']}{self.port(m['port'])}", text)

    def run(self, example: Example) -> None:
        text = example.text
        for old, new in example.replace:
            text = text.replace(old, new)
        text = "\n".join(l for l in text.split("\n") if not any(o in l for o in example.omit))
        text = self.localize(text)
        if example.file:
            (self.work / example.file).write_text(text)
        elif RUNNABLE.get(example.lang) == "python":
            self._check([sys.executable, "-"], example, stdin=text)
        elif RUNNABLE.get(example.lang) == "bash":
            self._bash(text, example)

    def _bash(self, text: str, example: Example) -> None:
        """Run the block as a script, each `llamabatch serve` line in the background."""
        script: list[str] = []
        for line in _joined(text):
            if SERVE.match(line) and not line.rstrip().endswith("&"):
                self._script(script, example)
                script = []
                self._serve(line, example)
            else:
                script.append(line)
        self._script(script, example)

    def _script(self, lines: list[str], example: Example) -> None:
        if any(l.strip() and not l.strip().startswith("#") for l in lines):
            self._check(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], example)

    def _check(self, command: list[str], example: Example, stdin: str | None = None) -> None:
        # Output goes to a file, not a pipe: a server the block leaves running (`serve ... &`)
        # would hold a pipe open, and reading it to its end would wait for the server.
        log = self.work / f"example-{example.line}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(command, cwd=self.work, env=self.env, text=True, start_new_session=True,
                                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
            self.groups.append(proc.pid)  # what it leaves running is stopped with the page
            try:
                proc.communicate(stdin, timeout=EXAMPLE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"{example.where}: no end after {EXAMPLE_TIMEOUT_S} s\n{log.read_text()[-4000:]}", pytrace=False)
        if proc.returncode != 0:
            pytest.fail(f"{example.where}: exit {proc.returncode}\n{example.text}\n{log.read_text()[-6000:]}", pytrace=False)

    def _serve(self, line: str, example: Example) -> None:
        found = PORT.search(line)
        port = int(found["port"]) if found else self.port(str(DEFAULT_PORT))
        if not found:
            line = SERVE.sub(lambda m: f"{m[0]} --port {port}", line, count=1)
        if port in self.servers:  # a later server on the page's port replaces the earlier one
            _stop(self.servers.pop(port))
        log = (self.work / f"serve-{port}.log").open("w")
        server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=self.work, env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        self.servers[port] = server
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        pytest.fail(f"{example.where}: `{line}` did not come up\n{(self.work / log.name).read_text()[-4000:]}", pytrace=False)

    def close(self) -> None:
        for server in self.servers.values():
            _stop(server)
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _joined(text: str) -> list[str]:
    """Lines, with backslash continuations joined."""
    return text.replace("\\\n", " ").split("\n")


def run_examples(page: Path, work: Path) -> None:
    """Every example of the page that is not skipped, in order, in the folder `work`."""
    runner = Page(work)
    try:
        for example in examples(page):
            if example.skip is None:
                runner.run(example)
    finally:
        runner.close()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_examples_run(page: Path, tmp_path: Path):
    write_files(tmp_path)
    run_examples(page, tmp_path)


def reading_order() -> list[Path]:
    """The README, then the site's pages in its navigation's order."""
    order: list[Path] = [ROOT / "README.md"]

    def walk(entries) -> None:
        for entry in entries:
            target = entry if isinstance(entry, str) else next(iter(entry.values()))
            if isinstance(target, list):
                walk(target)
            elif (ROOT / "docs" / target) in PAGES:
                order.append(ROOT / "docs" / target)

    # (mkdocs.yml names Python hooks with YAML tags a plain loader does not know)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)["nav"]
    walk(nav)
    return order


def test_a_reader_following_the_pages_in_order_in_one_folder_meets_no_refusal(tmp_path):
    """A newcomer runs every page's examples in the site's order, all in one folder: no page's
    files or outputs make a later page's commands fail (an output name reused for another job
    is refused, for one)."""
    write_files(tmp_path)
    for page in reading_order():
        run_examples(page, tmp_path)


def test_the_built_site_shows_lists_as_lists(tmp_path):
    """mkdocs builds the site (as CI does) without changing a tracked file, and no paragraph of it
    holds a list written as text: a list needs a blank line before it, which Markdown readers on
    GitHub forgive and Python-Markdown does not."""
    tracked = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    assert subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                          text=True).stdout == tracked

    class Paragraphs(html.parser.HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.depth, self.text, self.found = 0, [], []

        def handle_starttag(self, tag, attrs):
            if tag == "p":
                self.depth, self.text = self.depth + 1, []

        def handle_endtag(self, tag):
            if tag == "p" and self.depth:
                self.depth -= 1
                paragraph = "".join(self.text)
                if re.search(r"\n- ", paragraph):
                    self.found.append(paragraph[:120])

        def handle_data(self, data):
            if self.depth:
                self.text.append(data)

    run_on = []
    for page in (tmp_path / "site").rglob("*.html"):
        parser = Paragraphs()
        parser.feed(page.read_text())
        run_on += [f"{page.relative_to(tmp_path / 'site')}: {p!r}" for p in parser.found]
    assert not run_on, "\n".join(run_on)
