"""The engines' KV-cache events as vLLM publishes them, read into the precise prefix index.

vLLM's publisher (``vllm/distributed/kv_events.py``; the simulator's :mod:`sim.kv_publish` sends the
same) puts each batch on a ZMQ PUB socket as a multipart message: topic, sequence number (8 bytes,
big-endian), and a msgpack ``KVEventBatch``, ``[ts, events]`` (a trailing ``data_parallel_rank`` may
follow). Each event is an array tagged with its type: ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes,
medium]``, ``["AllBlocksCleared"]`` (older vLLMs leave out the trailing fields).

- :func:`decode_batch` (pure): a payload to the changes of the device cache: ``(STORED, keys,
  parent, tokens, block_size)``, ``(REMOVED, keys)``, ``(CLEARED,)``; events as positional arrays
  or, since vLLM's PR 42892, as maps with a ``type``. Blocks of another medium (vLLM's CPU offload tier)
  and event types it does not know are left out: the index mirrors what the engine reuses without
  a transfer.
- :func:`apply` (pure): those changes, in order, to a :class:`~ext_proc.prefix_events.EventIndex`,
  with ``keys: vllm`` re-keyed by :class:`~ext_proc.own_keys.OwnKeys`.
- :func:`publisher_address` (pure): an endpoint's publisher from the configured template.
- :class:`KvEventFeed`: what a picker runs (``inferlb serve``, ``inferlb ext-proc``): the subscriber
  below following the picker's view (a publisher per endpoint, subscribed as it joins, dropped as it
  leaves, checked each ``interval_s``), its changes applied to the picker's index on its loop.
- :func:`follows` (pure): a batch's sequence number against the last: batches lost, or a publisher
  that restarted (its numbers start again at 0; the subscriber then forgets the endpoint's blocks:
  a restarted engine's cache is empty, and vLLM sends no ``AllBlocksCleared`` at start).
- :class:`KvEventSubscriber`: the thin I/O shell: a thread with one SUB socket per endpoint that
  decodes each message and hands the changes to the owner's event loop
  (``loop.call_soon_threadsafe``): the index is read and written on that loop only, so the pick
  shares no lock with the thread. A malformed message is counted and dropped.

The ``pyzmq`` and ``msgpack`` packages are optional (``pip install 'inferlb[kv-events]'``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Gauge

from ext_proc.engine_keys import load_encoder, load_vllm_keys
from ext_proc.own_keys import OwnKeys
from ext_proc.prefix_events import EventIndex
from ext_proc.recent import RecentEndpoints, pinnable
from ext_proc.settings import PickerSettings
from ext_proc.view import ViewHolder

__all__ = ["CLEARED", "REMOVED", "STORED", "Change", "KvEventFeed", "KvEventSubscriber", "KvEventsUnavailable",
           "apply", "check_feed", "decode_batch", "follows", "publisher_address", "sequence_number", "start_feed"]

log = logging.getLogger(__name__)

#: The kinds of :data:`Change`.
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
#: One change of an engine's device cache: ``(STORED, keys, parent, tokens, block_size)``,
#: ``(REMOVED, keys)`` or ``(CLEARED,)`` (:func:`decode_batch`).
Change = tuple[Any, ...]
#: The ``medium`` of device blocks (None: a vLLM that does not say).
_DEVICE = ("GPU", None)
KV_EVENT_BATCHES = Counter(
    "inferlb_ext_proc_kv_event_batches",
    "KV-cache event batches the picker read from the engines' publishers, by outcome: applied (to the prefix-cache "
    "index), malformed (dropped), stale (from an endpoint that had left the view), lost (missing from the "
    "sequence numbers), restarted (a new publisher: the endpoint's blocks forgotten).", ["outcome"])
for _outcome in ("applied", "malformed", "stale", "lost", "restarted"):  # every series from the start, at 0:
    KV_EVENT_BATCHES.labels(_outcome)  # an alert on applied's rate sees 0, not nothing, when no engine publishes
KV_EVENT_PUBLISHERS = Gauge("inferlb_ext_proc_kv_event_publishers",
                            "Engines' KV-cache event publishers the picker subscribes to (a subscription, not "
                            "a publisher heard from: batches_total{outcome=\"applied\"} rising says events arrive).")
#: A placeholder of a publisher template: ``{host}``, ``{port}``, ``{port+N}``, ``{port-N}``.
_PLACEHOLDER = re.compile(r"\{(host|port)([+-][0-9]+)?\}")
#: How long the subscriber's thread waits for a message before it looks at its commands (ms).
POLL_MS = 100


def _key(value: object) -> int:
    """A block hash as the index keys it: an int as it is, bytes (vLLM's sha256 hashes) as a big-endian int."""
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big")
    raise ValueError(f"a block hash must be an int or bytes, got {type(value).__name__}")


#: A ``BlockStored``'s fields after its tag, in vLLM's order (``vllm/distributed/kv_events.py``): the
#: positional array of vLLM releases before its PR 42892 lists them so (trailing ones it omits when
#: they hold their default), the map of later ones names them.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _fields(event: object) -> tuple[object, list[object]]:
    """``(type, fields in vLLM's order)`` of one event, a positional array (``[type, ...]``) or a map
    (``{"type": ..., name: value}``, absent fields None).

    Raises:
        ValueError: neither.
    """
    if isinstance(event, list) and event:
        return event[0], event[1:]
    if isinstance(event, dict) and "type" in event:
        kind = event["type"]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        return kind, [event.get(name) for name in names]
    raise ValueError(f"a KV event is a tagged array or a map with a type, got {event!r:.80}")


def _plain(lora_id: object, lora_name: object, extra_keys: object) -> bool:
    """A stored block whose hash covers its tokens alone: no LoRA adapter, no extra keys (multimodal
    inputs, ``cache_salt``, prompt embeddings: vLLM's ``extra_keys``, one entry per block)."""
    return lora_id is None and lora_name is None and (
        not extra_keys or (isinstance(extra_keys, list) and all(k is None for k in extra_keys)))


def decode_batch(payload: bytes) -> list[Change]:
    """The device-cache changes of one ``KVEventBatch`` payload, oldest first (see the module docstring).

    A stored change is ``(STORED, keys, parent, tokens, block_size)``: ``tokens`` the blocks' token
    ids (a tuple) when their hashes cover those alone (:func:`_plain`; else None: the picker cannot
    key them) and ``block_size`` the event's (tokens). Events of a KV cache group other than the
    first (``group_idx`` > 0: a hybrid model's sliding-window or Mamba groups) are left out, as are
    blocks of another medium.

    Raises:
        ValueError: the payload is not a msgpack ``[ts, events, ...]`` array (or ``{ts, events}``
            map) of tagged events.
        ImportError: the ``msgpack`` package is not installed.
    """
    import msgpack

    try:
        batch = msgpack.unpackb(payload)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"not a msgpack KV event batch: {exc}") from None
    if isinstance(batch, dict):
        batch = [batch.get("ts"), batch.get("events")]
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV event batch is an array [ts, events, ...]")
    out: list[Change] = []
    for event in batch[1]:
        kind, f = _fields(event)
        if kind == "BlockStored" and len(f) >= 2 and isinstance(f[0], list):
            f += [None] * (len(_STORED_FIELDS) - len(f))
            hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys, group = f[:9]
            if medium in _DEVICE and group in (None, 0):
                plain = isinstance(tokens, list) and isinstance(block_size, int) and _plain(lora_id, lora_name,
                                                                                           extra_keys)
                out.append((STORED, tuple(map(_key, hashes)), None if parent is None else _key(parent),
                            tuple(tokens) if plain else None, block_size if plain else 0))
        elif kind == "BlockRemoved" and f and isinstance(f[0], list):
            medium = f[1] if len(f) > 1 else None
            group = f[2] if len(f) > 2 else None
            if medium in _DEVICE and group in (None, 0):
                out.append((REMOVED, tuple(map(_key, f[0]))))
        elif kind == "AllBlocksCleared":
            out.append((CLEARED,))
    return out


def sequence_number(parts: Sequence[bytes]) -> int | None:
    """The sequence number of a ``[topic, seq, payload]`` message (8 bytes, big-endian, signed, as
    vLLM sends it); None for another layout."""
    if len(parts) >= 3 and len(parts[-2]) == 8:
        return int.from_bytes(parts[-2], "big", signed=True)
    return None


def follows(last: int | None, seq: int) -> tuple[bool, int]:
    """``(restarted, lost)`` for a batch numbered ``seq`` after one numbered ``last`` (None: the first
    since subscribing). A publisher numbers its batches from 0, one by one: a number not above the
    last is a new publisher (the engine restarted, its cache empty, and vLLM sends no
    ``AllBlocksCleared`` at start); a jump is batches lost on the way (a high-water mark, a
    reconnection), ``lost`` of them.

    >>> follows(None, 7), follows(7, 8), follows(7, 10), follows(7, 0)
    ((False, 0), (False, 0), (False, 2), (True, 0))
    """
    if last is None:
        return False, 0
    if seq <= last:
        return True, 0
    return False, seq - last - 1


def apply(index: EventIndex, endpoint: str, changes: Sequence[Change], capacity: int,
          own: OwnKeys | None = None) -> None:
    """Apply one endpoint's ``changes`` (from :func:`decode_batch`) to ``index``, in order; ``capacity``:
    the bound of its held keys (:meth:`EventIndex.stored`). With ``own`` (``picker.kv_events.keys:
    vllm``), the index holds the picker's own keys of the blocks, not the engine's hashes
    (:class:`~ext_proc.own_keys.OwnKeys`); an unknown parent is looked for among the prompts the
    picker just sent there (:meth:`~ext_proc.own_keys.OwnKeys.resolve`), and a stored change it
    cannot key is dropped."""
    for change in changes:
        kind = change[0]
        if kind == STORED:
            if own is None:
                index.stored(endpoint, change[1], change[2], capacity)
            else:
                keyed = own.stored(endpoint, change[1], change[2], change[3], change[4], capacity)
                if keyed is None and change[2] is not None:  # an unknown parent: one the picker just sent?
                    chain = own.resolve(endpoint, change[2], change[3], change[4], index.recent(endpoint),
                                        index.last_sent(endpoint), capacity)
                    if chain is not None:
                        index.stored(endpoint, chain, None, capacity)
                        keyed = own.stored(endpoint, change[1], change[2], change[3], change[4], capacity)
                if keyed is not None:
                    index.stored(endpoint, keyed[0], keyed[1], capacity)
        elif kind == REMOVED:
            index.removed(endpoint, change[1] if own is None else own.removed(endpoint, change[1]))
        else:
            index.cleared(endpoint)
            if own is not None:
                own.cleared(endpoint)


class KvEventSubscriber:
    """Subscribes to every endpoint's KV event publisher and hands their changes to an event loop.

    Args:
        deliver: called on ``loop`` with ``(endpoint, changes)`` for each batch, in the order each
            publisher sent them (typically ``lambda e, c: apply(index, e, c, capacity)``).
        loop: the loop that owns the index.
        topic: the publishers' topic (vLLM's default: empty, every message).

    :meth:`start` runs the thread; :meth:`watch` sets which endpoints it subscribes to
    (``{endpoint: publisher address}``, e.g. ``{"10.0.0.1:8000": "tcp://10.0.0.1:5557"}``);
    :meth:`stop` ends it. ``dropped`` counts the malformed messages (read on any thread; also in
    ``inferlb_ext_proc_kv_event_batches_total{outcome="malformed"}``).

    Raises:
        ImportError: at :meth:`start`, ``pyzmq`` or ``msgpack`` is not installed.
    """

    def __init__(self, deliver: Callable[[str, list[Change]], None], loop: asyncio.AbstractEventLoop,
                 topic: str = "") -> None:
        self._deliver = deliver
        self._loop = loop
        self._topic = topic.encode()
        self._commands: queue.SimpleQueue[dict[str, str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def start(self) -> None:
        """Start the thread (once)."""
        import msgpack  # noqa: F401  (fail here, not in the thread)
        import zmq

        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(zmq,), name="kv-events", daemon=True)
            self._thread.start()

    def watch(self, publishers: Mapping[str, str]) -> None:
        """Subscribe to exactly these publishers from now on (``{endpoint: address}``; any thread)."""
        self._commands.put(dict(publishers))

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the thread and close its sockets (waits up to ``timeout_s``)."""
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self, zmq: Any) -> None:
        context = zmq.Context.instance()
        poller = zmq.Poller()
        sockets: dict[str, tuple[str, Any]] = {}  # endpoint -> (address, socket)
        by_socket: dict[Any, str] = {}
        last_seq: dict[str, int] = {}  # endpoint -> the last batch's sequence number
        try:
            while True:
                while not self._commands.empty():
                    wanted = self._commands.get()
                    if wanted is None:
                        return
                    for endpoint in [e for e, (a, _) in sockets.items() if wanted.get(e) != a]:
                        last_seq.pop(endpoint, None)
                        _, sock = sockets.pop(endpoint)
                        poller.unregister(sock)
                        del by_socket[sock]
                        sock.close(0)
                    for endpoint, address in wanted.items():
                        if endpoint not in sockets:
                            sock = context.socket(zmq.SUB)
                            sock.setsockopt(zmq.LINGER, 0)
                            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
                            sock.connect(address)
                            poller.register(sock, zmq.POLLIN)
                            sockets[endpoint] = (address, sock)
                            by_socket[sock] = endpoint
                for sock, _ in poller.poll(POLL_MS) if sockets else ():
                    endpoint = by_socket[sock]
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                        changes = decode_batch(parts[-1])
                    except zmq.Again:
                        continue
                    except ValueError as exc:
                        self.dropped += 1
                        KV_EVENT_BATCHES.labels("malformed").inc()
                        log.warning("kv events from %s: %s", endpoint, exc)
                        continue
                    seq = sequence_number(parts)
                    if seq is not None:
                        restarted, lost = follows(last_seq.get(endpoint), seq)
                        last_seq[endpoint] = seq
                        if lost:
                            KV_EVENT_BATCHES.labels("lost").inc(lost)
                        if restarted:  # a new publisher (the engine restarted): its cache starts empty
                            KV_EVENT_BATCHES.labels("restarted").inc()
                            log.warning("kv events from %s: the publisher restarted; its blocks forgotten", endpoint)
                            changes = [(CLEARED,), *changes]
                    if changes:
                        try:
                            self._loop.call_soon_threadsafe(self._deliver, endpoint, changes)
                        except RuntimeError:  # the loop is closed: nobody is left to read the index
                            return
                if not sockets:
                    threading.Event().wait(POLL_MS / 1000)
        finally:
            for _, sock in sockets.values():
                sock.close(0)


def publisher_address(template: str, endpoint: str) -> str:
    """The KV event publisher of ``endpoint`` (``HOST:PORT``, the view's form; ``[v6]:PORT`` too) from
    ``template``: ``{host}`` the endpoint's host, ``{port}`` its port, ``{port+N}`` / ``{port-N}`` its
    port plus or minus N.

    >>> publisher_address("tcp://{host}:5557", "10.0.0.1:8000"), publisher_address("tcp://{host}:{port+1000}", "h:8000")
    ('tcp://10.0.0.1:5557', 'tcp://h:9000')

    Raises:
        ValueError: ``endpoint`` has no port, ``{host}`` is followed by an offset, or the port comes
            out of 1-65535.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not HOST:PORT")

    def fill(m: re.Match[str]) -> str:
        name, offset = m.group(1), m.group(2)
        if name == "host":
            if offset:
                raise ValueError(f"{{host}} takes no offset: {template!r}")
            return host
        number = int(port) + int(offset or 0)
        if not 0 < number < 65536:
            raise ValueError(f"{template!r} gives {endpoint!r} the port {number}, outside 1-65535")
        return str(number)

    return _PLACEHOLDER.sub(fill, template)


class KvEventFeed:
    """The precise index's events for a running picker: a :class:`KvEventSubscriber` on the publisher
    of every endpoint of ``holder``'s view, applying their changes to ``index`` on the calling loop.

    Args:
        index: the picker's index (``RequestControl.prefixes`` with ``prefix_source: kv_events``).
        holder: the picker's view; its endpoints (every cluster's, spill tiers too) are followed, and
            its routing table's ``prefix_blocks`` bounds each endpoint's held keys.
        template: the publishers' address template (:func:`publisher_address`).
        topic: the publishers' topic.
        own: with ``picker.kv_events.keys: vllm``, the map of the engines' hashes to the picker's own
            keys (:func:`apply`); it forgets an endpoint as the feed drops it. None: the index holds
            the engines' hashes.
        clock: monotonic seconds (tests pass a fake one), for how long an endpoint that left stays followed.

    :meth:`run` (a task on the picker's loop) starts the subscriber, follows the view every
    ``interval_s`` and stops the subscriber when cancelled. Counted: the publishers subscribed to
    (``inferlb_ext_proc_kv_event_publishers``), the batches applied and those from an endpoint that
    had left (``inferlb_ext_proc_kv_event_batches_total{outcome}``). An endpoint that leaves the view's
    pinnable endpoints is unsubscribed :data:`ext_proc.recent.KEEP_S` later (a health flap keeps it),
    and the index forgets it then, at the picker's housekeeping (``RequestControl.tick``).

    Raises:
        ImportError: at :meth:`run`, ``pyzmq`` or ``msgpack`` is not installed.
    """

    def __init__(self, index: EventIndex, holder: ViewHolder, template: str, topic: str = "",
                 own: OwnKeys | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self._recent = RecentEndpoints(clock=clock)
        self.own = own
        self.holder = holder
        self.template = template
        self.topic = topic
        self.publishers: dict[str, str] = {}
        self._unaddressable: set[str] = set()  # endpoints without a publisher address, said once each
        """``{endpoint: publisher address}`` subscribed to now (read on the loop)."""
        self.subscriber: KvEventSubscriber | None = None

    def _deliver(self, endpoint: str, changes: list[Change]) -> None:
        if endpoint in self.publishers:  # not a batch that was on its way when the endpoint left
            apply(self.index, endpoint, changes, self.holder.current.routing.prefix_blocks, self.own)
            KV_EVENT_BATCHES.labels("applied").inc()
        else:
            KV_EVENT_BATCHES.labels("stale").inc()

    def follow(self) -> bool:
        """Subscribe to the publishers of the view's endpoints pinnable now or within
        :data:`ext_proc.recent.KEEP_S` (a health flap keeps the subscription); True when that changed
        (an endpoint whose address the template cannot fill is logged and left out)."""
        wanted: dict[str, str] = {}
        for endpoint in sorted(self._recent.update(pinnable(self.holder.current))):
            try:
                wanted[endpoint] = publisher_address(self.template, endpoint)
            except ValueError as exc:
                if endpoint not in self._unaddressable:
                    self._unaddressable.add(endpoint)
                    log.warning("kv events: no publisher for %s: %s", endpoint, exc)
        if wanted == self.publishers:
            return False
        self.publishers = wanted
        if self.own is not None:
            self.own.retain(wanted)
        KV_EVENT_PUBLISHERS.set(len(wanted))
        if self.subscriber is not None:
            self.subscriber.watch(wanted)
        return True

    async def run(self, interval_s: float = 1.0) -> None:
        """Start the subscriber and follow the view every ``interval_s`` until cancelled, then stop it."""
        self.subscriber = KvEventSubscriber(self._deliver, asyncio.get_running_loop(), self.topic)
        self.subscriber.start()
        self.publishers = {}
        try:
            while True:
                if self.follow():
                    log.info("kv events: subscribed to %d publishers", len(self.publishers))
                await asyncio.sleep(interval_s)
        finally:
            await asyncio.to_thread(self.subscriber.stop)
            self.subscriber = None


class KvEventsUnavailable(RuntimeError):
    """``picker.prefix_source: kv_events`` without the packages its subscriber needs."""


def check_feed(tokenizer: str | None, keys: str = "sim") -> None:
    """What ``picker.prefix_source: kv_events`` needs on this machine: ``pyzmq`` and ``msgpack``, and
    the Hugging Face tokenizer in ``tokenizer`` (a directory; None: none needed) loadable, for
    ``keys`` ``vllm`` with ``transformers`` and its chat template (:func:`~ext_proc.engine_keys.load_vllm_keys`).
    Called by :func:`start_feed` and by ``inferlb validate``, so both refuse the same configs.

    Raises:
        KvEventsUnavailable: a package is missing or the tokenizer cannot be loaded (the message
            names the setting).
    """
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        raise KvEventsUnavailable(f"picker.prefix_source: kv_events needs pyzmq and msgpack ({exc}): "
                                  "pip install 'inferlb[kv-events]'") from None
    if tokenizer is not None:
        try:
            if keys == "vllm":
                load_vllm_keys(tokenizer)
            else:
                load_encoder(tokenizer)
        except ModuleNotFoundError as exc:
            raise KvEventsUnavailable(f"picker.kv_events.keys: {keys} needs {exc.name}: "
                                      "pip install 'inferlb[vllm-keys]'" if keys == "vllm" else
                                      f"picker.kv_events.tokenizer: {exc}") from None
        except (ImportError, OSError, ValueError) as exc:
            raise KvEventsUnavailable(f"picker.kv_events.tokenizer: {exc}") from None


def start_feed(index: object, holder: ViewHolder, settings: PickerSettings) -> asyncio.Task[None] | None:
    """With ``settings.prefix_source`` ``kv_events`` and ``index`` an :class:`EventIndex` (what
    ``PickerHandler.from_settings`` made), a task on the running loop that runs its
    :class:`KvEventFeed`; else None. The view's routing table's tokenizer
    (:attr:`~ext_proc.view.RoutingTable.engine_tokenizer`) is loaded here, not at the first request;
    with :attr:`~ext_proc.view.RoutingTable.engine_keys` ``vllm``, the feed re-keys the engines'
    blocks (:class:`~ext_proc.own_keys.OwnKeys`).

    Raises:
        KvEventsUnavailable: ``pyzmq`` or ``msgpack`` is not installed, or the tokenizer cannot be
            loaded (said at start, naming the setting).
    """
    if settings.prefix_source != "kv_events" or not isinstance(index, EventIndex):
        return None
    routing = holder.current.routing
    check_feed(routing.engine_tokenizer, routing.engine_keys)
    feed = KvEventFeed(index, holder, settings.kv_events_endpoint, settings.kv_events_topic,
                       OwnKeys() if routing.engine_keys == "vllm" else None)
    return asyncio.get_running_loop().create_task(feed.run(), name="kv-events")
