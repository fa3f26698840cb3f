"""A private PulseAudio server with virtual devices, for audio tests without a sound card (DESIGN.md §8).

    from pulse import pulse  # the session-scoped fixture; request it before anything opens a device

Devices (all 16 kHz mono float32, so nothing is resampled inside the server):
- ``speaker``: a null sink; what is played to it is recorded from ``speaker.monitor`` (``record_speaker``).
- ``micfeed``: a null sink that tests play WAVs into (``play_into_mic``: ``paplay --device=micfeed``).
- ``virtual_mic``: ``module-remap-source`` of ``micfeed.monitor``: the microphone.
- ``keepalive``: a null sink that two ``module-loopback latency_msec=100`` streams read both monitors into.
  Without a low-latency reader a null sink renders in 2 s blocks and every capture is 1-2 s late.
- On request: ``echo_path()``, a ``module-loopback`` from ``speaker.monitor`` into ``micfeed``, so the mic hears
  what is played (a room's acoustic echo, without the room); ``echo_cancel()``, ``module-echo-cancel``
  (webrtc, else speex) with ``ec_speaker`` (plays to speaker, the canceller's reference) and ``ec_mic``
  (virtual_mic with the echo of ec_speaker removed).

How PortAudio reaches it: PortAudio uses ALSA, and ALSA's pulse plugin (``libasound2-plugins``) talks to the
server named by ``PULSE_SERVER``. ``ALSA_CONFIG_PATH`` is set to the system ``alsa.conf`` plus a file of ours
that defines one ``type pulse`` pcm per device (``pcm.virtual_mic``, ``pcm.speaker``, ``pcm.micfeed``), so
PortAudio lists them by those names (and ``default``/``pulse`` go to the server's defaults, speaker and
virtual_mic). These pcms exist whether or not the PulseAudio device does: a stream on a missing device fails
to open (what the reconnect tests need) instead of the device vanishing from PortAudio's list.

Environment (set in this process while the fixture lives, restored after): ``PULSE_SERVER=unix:<tmp>/native``,
``PULSE_RUNTIME_PATH=<tmp>`` (pacmd finds its socket there), ``ALSA_CONFIG_PATH``. The server itself also gets
``XDG_RUNTIME_DIR`` and ``HOME`` under tmp. PortAudio lists devices once, at ``import sounddevice``: the fixture
is session-scoped and sets the environment before the tests import sounddevice (runtime.voice.audio imports it
lazily); if sounddevice was imported earlier in the session, the fixture re-initializes PortAudio (safe only
while no stream is open, which is true between tests).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

APT_PACKAGES = "pulseaudio pulseaudio-utils libasound2-plugins libportaudio2"
RATE = 16000

SCRIPT = """\
load-module module-native-protocol-unix auth-anonymous=1 socket={rt}/native
load-module module-cli-protocol-unix socket={rt}/cli
load-module module-null-sink sink_name=speaker rate=16000 channels=1 format=float32le
load-module module-null-sink sink_name=micfeed rate=16000 channels=1 format=float32le
load-module module-null-sink sink_name=keepalive rate=16000 channels=1 format=float32le
{mic}
load-module module-loopback source=speaker.monitor sink=keepalive latency_msec=100 source_dont_move=true
load-module module-loopback source=micfeed.monitor sink=keepalive latency_msec=100 source_dont_move=true
set-default-sink speaker
set-default-source virtual_mic
"""
MIC_ARGS = ["source_name=virtual_mic", "master=micfeed.monitor", "channels=1", "rate=16000"]
ASOUND = "".join(f"pcm.{n} {{ type pulse; device {n} }}\n"
                 for n in ("virtual_mic", "speaker", "micfeed", "ec_mic", "ec_speaker"))
# module-echo-cancel between the speaker and the mic (echo_cancel()); gain control off: its AGC would turn
# virtual_mic's volume down to ~1/16 (measured) and change what every later test hears
EC_ARGS = ["source_name=ec_mic", "sink_name=ec_speaker", "source_master=virtual_mic", "sink_master=speaker",
           "use_master_format=1", 'aec_args="analog_gain_control=0 digital_gain_control=0 extended_filter=1"']
# extended_filter: the longer filter of webrtc's AEC; the echo path through null sinks and a loopback is longer
# than the ~50 ms the default one covers (residual echo measured: voiced runs up to 20-70 VAD windows without it,
# up to 9 with it)


def missing_tools() -> list[str]:
    return [t for t in ("pulseaudio", "pactl", "pacmd", "paplay", "parecord") if shutil.which(t) is None]


def write_wav(path, audio: np.ndarray, rate: int = RATE) -> Path:
    """16-bit mono WAV (paplay reads it; 16 kHz so the server does not resample)."""
    from runtime.voice.filemode import write_wav as write

    write(path, audio, rate)
    return Path(path)


def read_raw_f32(path) -> np.ndarray:
    return np.fromfile(path, "<f4")


class PulseServer:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.rt = self.root / "rt"
        self.proc: subprocess.Popen | None = None
        self.env = {
            "PULSE_SERVER": f"unix:{self.rt}/native",
            "PULSE_RUNTIME_PATH": str(self.rt),
            "ALSA_CONFIG_PATH": f"/usr/share/alsa/alsa.conf:{self.root / 'asound.conf'}",
        }
        self._saved: dict[str, str | None] = {}

    def start(self, timeout: float = 10.0) -> "PulseServer":
        self.rt.mkdir(parents=True, exist_ok=True)
        (self.root / "asound.conf").write_text(ASOUND)
        script = self.root / "script.pa"
        script.write_text(SCRIPT.format(rt=self.rt, mic="load-module module-remap-source " + " ".join(MIC_ARGS)))
        env = {**os.environ, **self.env, "XDG_RUNTIME_DIR": str(self.rt), "HOME": str(self.root)}
        self.log = open(self.root / "pulseaudio.log", "wb")
        self.proc = subprocess.Popen(
            ["pulseaudio", "-n", "-F", str(script), "--daemonize=no", "--exit-idle-time=-1",
             "--log-target=stderr", "--log-level=error"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pulseaudio exited {self.proc.returncode}: "
                                   f"{(self.root / 'pulseaudio.log').read_text()[-2000:]}")
            if self.pactl("info", check=False).returncode == 0:
                self.warm_up("virtual_mic", "speaker.monitor")
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("pulseaudio did not answer within %.0f s" % timeout)

    def warm_up(self, *sources: str, timeout: float = 5.0) -> None:
        """Record from each source until data flows. The first record stream on a fresh source waits ~1.9 s
        for its first data (measured; later streams ~50 ms): pay that here, not in the first test."""
        for src in sources:
            out = self.root / f"warm-{src}.raw"
            out.unlink(missing_ok=True)
            p = subprocess.Popen(["parecord", f"--device={src}", "--raw", "--latency-msec=10", str(out)],
                                 env=self._env())
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not (out.exists() and out.stat().st_size > 0):
                time.sleep(0.02)
            p.terminate()
            p.wait(5)

    def activate(self) -> None:
        """Point this process (and PortAudio, re-initialized if already loaded) at this server."""
        for k, v in self.env.items():
            self._saved[k] = os.environ.get(k)
            os.environ[k] = v
        sd = sys.modules.get("sounddevice")
        if sd is not None:  # PortAudio already listed devices without us: list them again
            sd._terminate()
            sd._initialize()

    def deactivate(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()

    # --- commands
    def _env(self):
        return {**os.environ, **self.env}

    def pactl(self, *args, check=True) -> subprocess.CompletedProcess:
        return subprocess.run(["pactl", *args], env=self._env(), capture_output=True, text=True, check=check)

    def pacmd(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(["pacmd", *args], env=self._env(), capture_output=True, text=True, check=True)

    def play_into_mic(self, wav, wait: bool = True) -> subprocess.Popen:
        """``paplay --device=micfeed WAV``: what virtual_mic then captures."""
        p = subprocess.Popen(["paplay", "--device=micfeed", "--latency-msec=20", str(wav)], env=self._env())
        if wait:
            p.wait(30)
        return p

    def record_speaker(self, path) -> subprocess.Popen:
        """Start ``parecord --device=speaker.monitor`` writing raw float32 16 kHz mono to path; stop it with
        ``.terminate()`` and read it with ``read_raw_f32``."""
        return subprocess.Popen(
            ["parecord", "--device=speaker.monitor", "--raw", "--format=float32le", "--rate=16000",
             "--channels=1", "--latency-msec=10", str(path)], env=self._env())

    def module_id(self, name_part: str) -> str | None:
        for line in self.pactl("list", "short", "modules").stdout.splitlines():
            if name_part in line:
                return line.split()[0]
        return None

    def remove_mic(self, kill_streams: bool = True) -> None:
        """Unload virtual_mic. PulseAudio 16 moves a stream whose source goes away to the fallback source (and
        back when it returns), so a client would never notice; ``kill_streams`` then kills the clients'
        record streams, as the removal of a real ALSA device does to them."""
        src = self.source_index("virtual_mic")
        clients = [line.split()[0] for line in self.pactl("list", "short", "source-outputs").stdout.splitlines()
                   if "protocol-native" in line and line.split()[1] == src]  # not a recorder of speaker.monitor
        # PulseAudio 16 makes the next source the default (speaker.monitor) and, when virtual_mic comes back,
        # moves every stream on the default to it: a recorder of speaker.monitor would record the mic instead.
        # A default that nothing records from avoids that.
        self.pactl("set-default-source", "keepalive.monitor")
        mid = self.module_id("source_name=virtual_mic")
        if mid is not None:
            self.pactl("unload-module", mid)
        if kill_streams:
            for so in clients:
                self.pacmd("kill-source-output", so)

    def source_index(self, name: str) -> str | None:
        for line in self.pactl("list", "short", "sources").stdout.splitlines():
            if line.split()[1] == name:
                return line.split()[0]
        return None

    def echo_path(self, latency_msec: int = 20) -> str:
        """Route what the speaker plays back into the mic (``speaker.monitor`` -> ``micfeed``, ~latency_msec
        late; ``adjust_time=0``: a fixed delay, as a room's, not one the loopback keeps resampling to hold);
        returns the module id for ``unload``."""
        return self.pactl("load-module", "module-loopback", "source=speaker.monitor", "sink=micfeed",
                          f"latency_msec={latency_msec}", "adjust_time=0", "source_dont_move=true",
                          "sink_dont_move=true"
                          ).stdout.strip()

    def echo_cancel(self) -> tuple[str, str]:
        """Load module-echo-cancel between ``speaker`` and ``virtual_mic`` (aec_method webrtc, else speex):
        play to ``ec_speaker``, record ``ec_mic``. Returns (module id, method)."""
        errors = []
        for method in ("webrtc", "speex"):
            r = self.pactl("load-module", "module-echo-cancel", f"aec_method={method}", *EC_ARGS, check=False)
            if r.returncode == 0:
                self.warm_up("ec_mic")
                return r.stdout.strip(), method
            errors.append(f"{method}: {r.stderr.strip()}")
        raise RuntimeError(f"module-echo-cancel did not load ({'; '.join(errors)})")

    def unload(self, module_id: str) -> None:
        self.pactl("unload-module", module_id, check=False)

    def restore_mic(self) -> None:
        self.pactl("load-module", "module-remap-source", *MIC_ARGS)
        self.pactl("set-default-source", "virtual_mic")
        self.warm_up("virtual_mic")


@pytest.fixture(scope="session")
def pulse(tmp_path_factory):
    """A running private PulseAudio server (PulseServer), active in this process for the whole session."""
    missing = missing_tools()
    if missing:
        pytest.skip(f"needs PulseAudio ({', '.join(missing)} not found): apt-get install {APT_PACKAGES}")
    try:
        import sounddevice  # noqa: F401  (only checks that PortAudio loads; devices are listed again below)
        import soxr  # noqa: F401
    except (ImportError, OSError) as e:
        pytest.skip(f"needs sounddevice, soxr and libportaudio2 ({e}): pip install 'boardtalk[voice]'; "
                    f"apt-get install {APT_PACKAGES}")
    server = PulseServer(tmp_path_factory.mktemp("pulse")).start()
    server.activate()
    yield server
    server.deactivate()
    server.stop()
