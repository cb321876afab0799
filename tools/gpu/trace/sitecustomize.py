"""A timeline of a serving run across its processes (client, API server,
engine core) or of an offline run: with PAGODA_TRACE_DIR set and this folder
on PYTHONPATH, every Python process that imports the parts below appends
tab-separated records to PAGODA_TRACE_DIR/<pid>.tsv (wall-clock seconds, so
the processes line up):

  sched   t  running  waiting  prefill_tokens  decode_rows   (Scheduler.schedule)
  intake  t                                                  (Processor.process: a request reaches the front end)
  client  t_sent  ttft  latency  ok                          (pagoda bench serve, one request)

tools/gpu/trace_summary.py bins them. The parts are patched after they are
imported (a meta-path hook), so processes that never import them pay nothing.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_dir = os.environ.get("PAGODA_TRACE_DIR")
_file = None


def _write(*fields):
    global _file
    if _file is None:
        # Line-buffered: spawned processes end with os._exit, which skips atexit.
        _file = open(os.path.join(_dir, f"{os.getpid()}.tsv"), "a", buffering=1)
    _file.write("\t".join(map(str, fields)) + "\n")


def _patch_scheduler(module):
    schedule = module.Scheduler.schedule

    def traced(self):
        output = schedule(self)
        prefill = decode = 0
        for item in output.scheduled:
            if item.start_position < item.num_prompt_tokens:
                prefill += len(item.token_ids)
            else:
                decode += 1
        _write("sched", f"{time.time():.6f}", len(self.running), len(self.waiting), prefill, decode)
        return output

    module.Scheduler.schedule = traced


def _patch_processor(module):
    process = module.Processor.process

    def traced(self, *args, **kwargs):
        _write("intake", f"{time.time():.6f}")
        return process(self, *args, **kwargs)

    module.Processor.process = traced


def _patch_client(module):
    send = module.async_request_openai_completions

    async def traced(*args, **kwargs):
        sent = time.time()
        output = await send(*args, **kwargs)
        _write("client", f"{sent:.6f}", f"{output.ttft:.6f}", f"{output.latency:.6f}", int(output.success))
        return output

    module.async_request_openai_completions = traced


_PATCHES = {"pagoda.core.scheduler": _patch_scheduler, "pagoda.engine.processor": _patch_processor,
            "pagoda.benchmarks.serve": _patch_client}


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _Loader(spec.loader, _PATCHES[name])
        return spec


if _dir:
    os.makedirs(_dir, exist_ok=True)
    sys.meta_path.insert(0, _Finder())
