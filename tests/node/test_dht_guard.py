"""node/swarm/dht_guard.py's checks of a dictionary value in a DHT store request or find reply (pure)."""

import time
import tracemalloc

import msgpack
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils.serializer import MSGPackSerializer

from hivespec.node.swarm.dht_guard import MAX_DICTIONARY_BYTES, MAX_SUBKEYS_PER_VALUE, check_dictionary_value


def _dictionary(subkeys: int) -> bytes:
    value, expires = DictionaryDHTValue(), time.time() + 600
    for i in range(subkeys):
        value.store(f"hs{i:016x}", b"record", expires)
    return MSGPackSerializer.dumps(value)


def test_hivemind_dictionaries_up_to_the_subkey_limit_pass_and_one_more_is_refused_by_name():
    assert check_dictionary_value(_dictionary(0)) is None
    assert check_dictionary_value(_dictionary(MAX_SUBKEYS_PER_VALUE)) is None
    assert check_dictionary_value(_dictionary(MAX_SUBKEYS_PER_VALUE + 1)) == "too_many_subkeys"


def test_a_dictionary_of_millions_of_empty_arrays_is_refused_before_they_are_built():
    # Any DHT peer may send it in a store request: 4.4 MB of one-byte empty arrays where the subkeys go were 4 million
    # lists (320 MiB, seconds of the DHT's event loop) before the subkey count refused them.
    n = MAX_DICTIONARY_BYTES - 32
    data = msgpack.packb(msgpack.ExtType(0x50, b"\x93\x00\x00\xdd" + n.to_bytes(4, "big") + b"\x90" * n))
    assert len(data) <= MAX_DICTIONARY_BYTES
    tracemalloc.start()
    try:
        reason = check_dictionary_value(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reason == "bad_dictionary"
    assert peak < 2 * len(data)  # the ext's payload is copied once
