"""llama.cpp's converter (``convert_hf_to_gguf.py``, from the llama-cpp-python 0.3.36 sdist) as an independent
oracle for GGUF.  llama.cpp's runtime is not a test dependency (llama-cpp-python compiles llama.cpp for ~8
minutes): scripts/gguf_llama_cpp_check.py runs it by hand on both converters' files.

Where the converter comes from (``converter_source``): ``MOESWARM_LLAMA_CPP_SRC`` (a ``vendor/llama.cpp``
folder) if set; else the sdist, downloaded from PyPI with pip once into ``$MOESWARM_TEST_CACHE`` (default
``~/.cache/moeswarm-tests``) and reduced to what the converter imports: ``convert_hf_to_gguf.py``, its
``conversion`` package and ``gguf-py``.  A failed download fails the test with ``HOW``.

The tiny oracle checkpoints have no tokenizer, and llama.cpp's converter recognises a BPE tokenizer by
hashing its ids of a test text, so ``convert`` runs the converter unchanged except for its vocabulary
step: the file gets a plain SentencePiece-style vocabulary of ``vocab_size`` tokens (the 256 byte tokens,
then ``<tN>``), which llama.cpp loads.  Every tensor and hyper-parameter is llama.cpp's converter's own.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from engine_support import locked

VERSION = "0.3.36"
# what convert_hf_to_gguf.py imports from its tree (conversion/ reads models/templates only for the chat
# templates of the vocabulary step, which ``convert`` replaces)
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
HOW = (f"llama.cpp's converter is this test's oracle: it is fetched with `python -m pip download --no-deps "
       f"--no-binary llama-cpp-python llama-cpp-python=={VERSION}` (needs PyPI), or set MOESWARM_LLAMA_CPP_SRC to the "
       f"vendor/llama.cpp folder of that sdist")


def cache_root() -> Path:
    return Path(os.environ.get("MOESWARM_TEST_CACHE") or Path.home() / ".cache" / "moeswarm-tests")


def converter_source() -> Path:
    """The ``vendor/llama.cpp`` folder holding llama.cpp's converter (see the module's docstring); two
    pytest-xdist workers asking at once download it once (a file lock)."""
    if os.environ.get("MOESWARM_LLAMA_CPP_SRC"):
        src = Path(os.environ["MOESWARM_LLAMA_CPP_SRC"])
        assert (src / "convert_hf_to_gguf.py").is_file(), f"MOESWARM_LLAMA_CPP_SRC={src}: no convert_hf_to_gguf.py. {HOW}"
        return src
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"llama.cpp-{VERSION}"
    with locked(root / f"llama.cpp-{VERSION}.lock"):
        if not (src / "convert_hf_to_gguf.py").is_file():
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                # the sdist (no binary of llama-cpp-python), its build backend as wheels: pip prepares the sdist's
                # metadata, and `--no-binary :all:` would compile scikit-build-core's own build chain for it
                done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                                       "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-d", tmp],
                                      capture_output=True, text=True, timeout=900, check=False)
                sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
                assert done.returncode == 0 and sdists, \
                    f"could not download llama-cpp-python {VERSION}'s sdist:\n{done.stderr[-2000:]}\n{HOW}"
                out = Path(tmp) / "llama.cpp"
                prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
                with tarfile.open(sdists[0]) as tar:
                    members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                               and m.name[len(prefix):].startswith(PARTS)]
                    for m in members:
                        m.name = m.name[len(prefix):]
                    tar.extractall(out, members=members, filter="data")
                assert (out / "convert_hf_to_gguf.py").is_file(), f"{sdists[0].name} holds no {prefix}convert_hf_to_gguf.py"
                shutil.rmtree(src, ignore_errors=True)  # an extraction that died half way
                out.rename(src)
    return src


# One process per source tree imports the converter (torch, transformers: ~3 s) once, then forks a child per
# conversion: the child patches what ``convert`` changes (the vocabulary step, ``--raw-config``), runs the
# converter's ``main`` and exits, so no conversion sees another's patches and none pays the imports again.
_SERVER = r"""
import importlib, importlib.util, json, os, sys, traceback
src = sys.argv[1]
sys.path.insert(0, src)
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", src + "/convert_hf_to_gguf.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
gguf = mod.gguf
TextModel = importlib.import_module("conversion").TextModel

def run(folder, out, outtype, extra):
    def synthetic_vocab(self):
        n = self.hparams.get("vocab_size") or self.hparams.get("text_config", {}).get("vocab_size")
        tokens = [f"<0x{i:02X}>" for i in range(256)] + [f"<t{i}>" for i in range(256, n)]
        types = [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (n - 256)
        self.gguf_writer.add_tokenizer_model("llama")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_scores([0.0] * n)
        self.gguf_writer.add_token_types(types)
        self.gguf_writer.add_add_bos_token(False)
    
    def get_model_class(*args, **kwargs):
        cls = real(*args, **kwargs)  # its module is imported now: every class that sets a vocabulary is loaded
        todo, seen = [TextModel], set()
        while todo:
            c = todo.pop()
            if c not in seen:
                seen.add(c)
                if "set_vocab" in vars(c) or c is TextModel:
                    c.set_vocab = synthetic_vocab
                todo.extend(c.__subclasses__())
        return cls
    
    class HubConfig:  # --raw-config: the config.json as the hub's remote-code checkpoints have it, not transformers' form
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise ValueError("reading config.json itself (--raw-config)")
    
    if "--raw-config" in extra:
        extra.remove("--raw-config")
        importlib.import_module("conversion.base").AutoConfig = HubConfig
    
    real = mod.get_model_class
    mod.get_model_class = get_model_class
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype, *extra]
    mod.main()

for line in sys.stdin:
    folder, out, outtype, extra, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            run(folder, out, outtype, list(extra))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""
_servers: dict[Path, subprocess.Popen[str]] = {}


def _server(src: Path) -> subprocess.Popen[str]:
    process = _servers.get(src)
    if process is None or process.poll() is not None:
        atexit.register(close_converters)  # for scripts; the tests' fixture stops them itself
        process = _servers[src] = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(src)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return process


def close_converters() -> None:
    """Stop the converter processes ``convert`` started (their stdin closed: they exit)."""
    while _servers:
        _, process = _servers.popitem()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def convert(src: Path, folder: Path, out: Path, outtype: str = "f32", *extra: str) -> Path:
    """llama.cpp's converter in ``src`` (``converter_source()``) on ``folder`` (a transformers checkpoint) -> ``out``;
    ``extra``: more of its command-line options (``--no-mtp``), and ``--raw-config``: the converter reads config.json
    as it is rather than through transformers' ``AutoConfig`` (what it does when transformers does not know the
    model type, as for the hub's remote-code MiMo-V2-Flash; transformers 5.24 knows it and rewrites the hub's
    keys into a form llama.cpp's MimoV2Model does not read).  Runs in a child of one converter process per
    ``src`` (``close_converters`` stops them)."""
    log = out.with_name(out.name + ".converter.log")
    process = _server(src)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps([str(folder), str(out), outtype, list(extra), str(log)]) + "\n")
    process.stdin.flush()
    reply = process.stdout.readline()  # the converter's own run is bounded by the test's timeout
    stderr = log.read_text(errors="replace") if log.is_file() else ""
    assert reply.strip() == "0" and out.is_file(), f"llama.cpp's converter failed ({reply.strip() or 'died'}):\n{stderr[-3000:]}"
    return out
