"""``boardtalk serve``: one process, one model; the voice loop, the HTTP API and Wyoming as the config enables.

Start: load the artifact, prefill the system prompt (the API's session and the voice loop's), start what is
enabled, then report ready (``/health`` 200, systemd ``READY=1``). SIGTERM/SIGINT: ``STOPPING=1``, take no
new work, let the running turn finish for ``service.stop_timeout_s`` then cancel it (within one step), exit 0.
SIGHUP: reload the config file; what applies at once is listed in RELOADABLE, other changes are logged as
needing a restart.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
import time

from .config import Config, ConfigError, check, load_config, with_overrides
from .metrics import Metrics
from .scheduler import AsyncJob, ComputeGate, GatedModel, Scheduler

log = logging.getLogger(__name__)
# keys a SIGHUP applies without a restart; the rest are read once at start
RELOADABLE = {"api": ("api_key", "max_tokens", "queue", "body_limit_kib", "read_timeout_s"),
              "model": ("system_prompt",), "service": ("log_level", "stop_timeout_s")}


def _systemd():
    """runtime/serve/systemd.py (notify, Watchdog), or a stand-in that does nothing if it is not there."""
    try:
        from . import systemd
        return systemd
    except ImportError as e:
        log.debug("systemd integration unavailable: %s", e)

        class _None:
            @staticmethod
            def notify(*states):
                return False

            class Watchdog:
                @staticmethod
                def from_env():
                    return None
        return _None


def _close_result(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None and hasattr(fut.result(), "close"):
        fut.result().close()


class _Stopped(Exception):
    """A stop was requested during start-up."""


class Service:
    """The running service; the HTTP API reads ``config``, ``scheduler``, ``metrics``, ``ready``, ``model_name``."""

    def __init__(self, config: Config, loader, config_path=None, overrides: dict | None = None):
        self.config = config
        self.config_path = config_path  # reread on SIGHUP; None = nothing to reload
        self.overrides = overrides or {}  # {section: {key: value}} the command line set; applied again on reload
        self._loader = loader  # ModelSection -> Model (the CLI builds the default artifact on first use)
        self.metrics = Metrics()
        self.ready = self.stopping = False
        self.started_at = int(time.time())
        self.model = self.scheduler = self.gate = self.voice = None
        self.model_name = "boardtalk"
        self.api_port: int | None = None
        self.wyoming_port: int | None = None
        self._stop: asyncio.Event | None = None
        self._sd = _systemd()
        self._watchdog = None

    # ---- the watchdog's beat: every step of either session, and idle ticks -----------------------
    def _beat(self) -> None:
        if self._watchdog is not None:
            self._watchdog.beat()

    def request_stop(self) -> None:
        if self._stop is not None and not self._stop.is_set():
            log.info("stopping")
            self._stop.set()

    # ---- start -----------------------------------------------------------------------------------
    async def run(self, on_ready=None) -> int:
        """Serve until request_stop() (or SIGTERM/SIGINT when run in the main thread); returns the exit status."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._install_signals(loop)
        self._watchdog = self._sd.Watchdog.from_env() if cfg.service.watchdog else None
        if self._watchdog is not None:
            self._watchdog.start()
        runner = wy_task = None
        try:
            t0 = time.monotonic()
            if cfg.api.enabled:  # first, so that /health answers 503 while loading
                from .api import start_api

                runner, self.api_port = await start_api(self, cfg.api.host, cfg.api.port)
            self.model = await self._unless_stopped(self._loader, cfg.model)
            man = self.model.manifest
            self.model_name = str((man.source or {}).get("registry_name") or man.model_name)
            self.gate = ComputeGate(on_step=self._beat)
            self.scheduler = Scheduler(self.model, self.gate, queue_bound=cfg.api.queue,
                                       system_prompt=cfg.model.system_prompt, metrics=self.metrics, beat=self._beat)
            warm = await asyncio.to_thread(self.scheduler.warm)
            self.scheduler.start()
            if cfg.audio.enabled:
                from .voice import VoiceService

                self.voice = VoiceService(self.model, self.gate, cfg, self.metrics)
                await asyncio.to_thread(self.voice.start)
            if cfg.wyoming.enabled:
                wy_task = await self._start_wyoming(cfg)
            self.ready = True
            self.metrics.ready.set(1)
            self._sd.notify("READY=1", f"STATUS=serving {self.model_name}")
            log.info("ready in %.2f s: %s (system prompt %d tokens prefilled); api %s; wyoming %s; voice %s",
                     time.monotonic() - t0, self.model_name, warm,
                     f"http://{cfg.api.host}:{self.api_port}" if runner else "off",
                     f"tcp://{cfg.wyoming.host}:{self.wyoming_port}" if wy_task else "off",
                     self.voice.describe() if self.voice else "off")
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
        except _Stopped:
            log.info("stop requested while loading the model; not starting")
        finally:
            await self._shutdown(runner, wy_task)
        return 0

    async def _unless_stopped(self, fn, *args):
        """fn(*args) on a daemon thread, awaited unless a stop comes first (then _Stopped): loading, or
        building the default artifact on first use, takes seconds to minutes and cannot be interrupted
        midway, so SIGTERM/Ctrl-C leave it running and the process exits without waiting for it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result, error) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def work() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is gone (stopped meanwhile): nobody is waiting
                if result is not None and hasattr(result, "close"):
                    result.close()

        threading.Thread(target=work, name="boardtalk-load", daemon=True).start()
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({fut, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not fut.done():
            fut.add_done_callback(_close_result)  # loaded after all while we shut down: free it
            raise _Stopped()
        return fut.result()

    async def _start_wyoming(self, cfg):
        try:
            from .wyoming import serve_wyoming
        except ImportError as e:
            log.error("wyoming is unavailable (%s); serving without it", e)
            return None
        from ..voice.engines import open_engine

        a = cfg.audio
        asr, tts = await asyncio.to_thread(lambda: (open_engine("asr", a.asr), open_engine("tts", a.tts)))
        ready = asyncio.Event()
        self.wyoming_port = cfg.wyoming.port

        def on_listen(port: int) -> None:
            self.wyoming_port = port

        task = asyncio.create_task(serve_wyoming(cfg.wyoming.host, cfg.wyoming.port, asr=asr, tts=tts,
                                                 llm=self.llm_stream, stop=self._stop, ready=ready,
                                                 llm_name=self.model_name, on_listen=on_listen))
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            waiter.cancel()
            task.result()  # it failed to start: raise (a port in use is the user's to fix)
        return task

    async def llm_stream(self, text: str, source: str = "wyoming"):
        """The reply's text deltas to one user utterance, through the scheduler; closing it cancels."""
        from ..sampling import GenerationConfig

        msgs = [{"role": "user", "content": text}]
        if self.config.model.system_prompt:
            msgs.insert(0, {"role": "system", "content": self.config.model.system_prompt})
        job = AsyncJob(msgs, GenerationConfig(max_new_tokens=self.config.audio.max_new_tokens), source,
                       loop=asyncio.get_running_loop())
        self.scheduler.submit(job)
        try:
            while True:
                kind, value = await job.next()
                if kind == "delta":
                    yield value
                elif kind == "error":
                    raise value
                elif kind == "done":
                    return
        finally:
            if not job.done.is_set():
                job.request_cancel("disconnect")

    # ---- signals and reload ------------------------------------------------------------------------
    def _install_signals(self, loop) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # tests run the service in a thread and stop it with request_stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    def reload(self) -> bool:
        """Reread the config file; apply what can change while running. A bad file keeps the old config."""
        if self.config_path is None:
            log.warning("SIGHUP: no config file to reload (started without one)")
            return False
        try:
            new = with_overrides(load_config(self.config_path), **self.overrides)
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded, keeping the running one: %s", e)
            return False
        old = self.config
        merged = {}
        for name in ("model", "api", "wyoming", "audio", "service"):
            o, n = getattr(old, name), getattr(new, name)
            keep = {}
            for f in dataclasses.fields(o):
                ov, nv = getattr(o, f.name), getattr(n, f.name)
                if ov != nv and f.name not in RELOADABLE.get(name, ()):
                    log.warning("SIGHUP: %s.%s changed; it applies after a restart", name, f.name)
                    keep[f.name] = ov
            merged[name] = dataclasses.replace(n, **keep)
        cfg = Config(**merged)
        try:  # the rules between keys, on what will run: e.g. the running host with the reloaded api_key
            check(cfg)
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded, keeping the running one: %s", e)
            return False
        self.config = cfg
        if self.scheduler is not None:
            self.scheduler.queue_bound = cfg.api.queue
            if cfg.model.system_prompt != old.model.system_prompt:
                self.scheduler.system_prompt = cfg.model.system_prompt  # the next request prefills it once
        logging.getLogger().setLevel(cfg.service.log_level.upper())
        log.info("SIGHUP: config %s reloaded", self.config_path)
        return True

    # ---- stop ----------------------------------------------------------------------------------------
    async def _shutdown(self, runner, wy_task) -> None:
        self.stopping, self.ready = True, False
        self.metrics.ready.set(0)
        self._sd.notify("STOPPING=1")
        t0 = time.monotonic()
        grace = self.config.service.stop_timeout_s
        waits = []
        if self.scheduler is not None:
            waits.append(asyncio.to_thread(self.scheduler.stop, grace))
        if self.voice is not None:
            waits.append(asyncio.to_thread(self.voice.stop, grace))
        await asyncio.gather(*waits, return_exceptions=True)
        if wy_task is not None:
            try:
                await asyncio.wait_for(wy_task, 1.0)
            except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - stopping regardless
                log.debug("wyoming server stop: %r", e)
        if runner is not None:
            await runner.cleanup()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.model is not None:
            self.model.close()
        log.info("stopped in %.2f s", time.monotonic() - t0)


class Background:
    """The service on its own thread and event loop, for tests and scripts/soak.py:

        with Background(config, loader) as svc:   # returns once ready (raises what start-up raised)
            ... http://127.0.0.1:{svc.api_port} ...
    """

    def __init__(self, config: Config, loader, timeout_s: float = 300.0):
        self.service = Service(config, loader)
        self.timeout_s = timeout_s
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._main, name="boardtalk-serve", daemon=True)

    def _main(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            return await self.service.run(on_ready=lambda s: self._ready.set())

        try:
            self.exit_code = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._error = e
        finally:
            self._ready.set()

    def __enter__(self) -> Service:
        self._thread.start()
        if not self._ready.wait(self.timeout_s):
            raise TimeoutError(f"service not ready within {self.timeout_s} s")
        if self._error is not None:
            raise self._error
        return self.service

    def stop(self) -> float:
        """Stop it; returns the seconds it took."""
        t0 = time.monotonic()
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.service.request_stop)
        self._thread.join(timeout=30)
        return time.monotonic() - t0

    def __exit__(self, *exc) -> None:
        self.stop()
