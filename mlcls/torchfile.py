"""A ``torch.save`` file checked as torch will read it, before ``torch.load`` runs (:func:`open_checkpoint`).

* **One zip reader.** torch's reader (miniz) takes the last end-of-directory signature within the last
  64 KiB + 22 bytes and reads the directory at the offset that record states (its zip64 record's, where a
  zip64 locator precedes it). Python's ``zipfile`` instead reads the directory that ends where the end record
  starts, and calls any gap prepended data. The directory is found here as miniz finds it, and must end
  exactly where the end record (or its zip64 record) starts: both readers then see the same one. Every
  member of that directory is checked: stored (``torch.save`` never compresses), its declared sizes equal,
  its bytes inside the file before the directory, no two overlapping, no name twice (ignoring case: miniz
  looks names up so) and none with a NUL (miniz's lookup stops there).
* **A bounded pickle.** ``data.pkl`` is at most ``CAPS["checkpoint pickle"]`` and is scanned with
  ``pickletools.genops`` (streaming, no object built): at most :data:`PICKLE_OPCODES` opcodes, of which at
  most :data:`PICKLE_OBJECTS` build a container or an object or store one in the memo, and tuples (hashed as
  dictionary keys, in C, recursively) nested at most :data:`MAX_NESTING` deep. Each storage it refers to is
  named by a member's exact name: torch reads a storage once per key, so distinct keys that its reader would
  resolve to one member (differing in case, or after a NUL) would read that member again for each.
* **A bounded nesting.** What ``torch.load`` built nests at most :data:`MAX_NESTING` containers deep
  (:func:`check_nesting`, without recursion), so no later deep copy or config walk recurses out.

Loading a checkpoint of N bytes then holds at most N (its tensors, each stored member read once) plus 16 MiB
(``data.pkl``) plus what the capped opcodes build: measured at most 96 MiB (a 16 MiB string held at four
bytes a character) and 67 MiB (2^19 integer-keyed dictionary entries), under 200 MiB together
(docs/inference.md).
"""

from __future__ import annotations

import io
import pickletools
import struct
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NamedTuple

from mlcls.io import CAPS, UnsafeFileError, describe_size, open_regular

PICKLE_OPCODES = 2**20  # a real checkpoint's data.pkl: about 40 opcodes per tensor, 13,000 for 330 tensors
PICKLE_OBJECTS = 2**18
MAX_NESTING = 32  # containers within containers (an mlcls checkpoint nests about 6 deep)

_END = struct.Struct("<4s4H2LH")  # end of central directory: disks, entries, directory size and offset
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_ENTRY = struct.Struct("<4s6H3L5H2L")  # a central directory entry
_LOCAL = struct.Struct("<4s5H3L2H")  # a member's local header
_MAX_COMMENT = 0xFFFF
_MINIZ_BLOCK = 4096  # miniz scans for the end record in blocks of this many bytes
_UNSET32 = 0xFFFFFFFF  # a size or offset held in the zip64 extra field instead

# Opcodes that make a container or an object, or store one in the memo (an entry that holds it).
_BUILDS = frozenset(
    {
        *("EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET", "DICT", "LIST", "FROZENSET"),
        *("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD", "INST", "OBJ"),
        *("PERSID", "BINPERSID", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"),
    }
)
# Opcodes that build a tuple or a frozenset (hashed recursively): how many stack entries it takes, None: to
# the mark
_TUPLES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "TUPLE": None, "FROZENSET": None}
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


class _Refused(ValueError):
    """What is wrong with an archive, in one phrase (:func:`open_checkpoint` names the file)."""


class _NotArchive(_Refused):
    """No zip archive as torch's reader finds one."""


ReadAt = Callable[[int, int], bytes]


def _reader(file: IO[bytes], size: int) -> ReadAt:
    """``read_at(offset, count)``: exactly ``count`` bytes of ``file`` at ``offset`` (else refused)."""

    def read_at(offset: int, count: int) -> bytes:
        if offset < 0 or offset + count > size:
            raise _NotArchive(f"a record at byte {offset} ({count} bytes) lies outside its {size} bytes")
        file.seek(offset)
        data = file.read(count)
        if len(data) != count:
            raise _NotArchive(f"it ends within the record at byte {offset}")
        return data

    return read_at


def _directory(read_at: ReadAt, size: int) -> tuple[int, int, int]:
    """``(entries, offset, size)`` of the central directory, as miniz finds it, ending where the end
    record (or the zip64 record) starts."""
    window = min(size, _MAX_COMMENT + _END.size + _MINIZ_BLOCK)  # all miniz's scan may reach
    tail = read_at(size - window, window)
    at = tail.rfind(b"PK\x05\x06", 0, window - _END.size + 4)  # the last one with a whole record after it
    if at < 0:
        raise _NotArchive("no end-of-directory record")
    end = size - window + at
    _, disk, directory_disk, here, entries, length, offset, comment = _END.unpack_from(tail, at)
    if end + _END.size + comment != size:
        raise _NotArchive(
            f"its end-of-directory record at byte {end} is followed by {size - end - _END.size} bytes, "
            f"not by the {comment} bytes of its comment"
        )
    if disk or directory_disk or here != entries:
        raise _NotArchive("it spans several disks")
    directory_end = end
    if end >= _END64_LOCATOR.size + _END64.size:
        signature, _, end64, disks = _END64_LOCATOR.unpack(read_at(end - _END64_LOCATOR.size, 20))
        if signature == b"PK\x06\x07" and end64 <= size - _END64.size:
            record = _END64.unpack(read_at(end64, _END64.size))
            if record[0] == b"PK\x06\x06":  # what miniz then reads: the zip64 record's counts
                if disks != 1 or record[4] or record[5] or record[6] != record[7]:
                    raise _NotArchive("it spans several disks")
                if end64 + 12 + record[1] != end - _END64_LOCATOR.size:
                    raise _NotArchive(
                        f"bytes lie between its zip64 end record (byte {end64}) and its locator"
                    )
                entries, length, offset = record[7], record[8], record[9]
                directory_end = end64
    if offset + length != directory_end:
        raise _NotArchive(
            f"its directory (byte {offset}, {length} bytes) does not end where its end record starts "
            f"(byte {directory_end}): prepended data or a second directory"
        )
    if entries * _ENTRY.size > length:
        raise _NotArchive(f"its directory of {length} bytes cannot hold {entries} entries")
    return entries, offset, length


def _zip64_values(extra: bytes, values: list[int]) -> list[int]:
    """``values`` (uncompressed size, compressed size, local header offset) with each one set to
    0xFFFFFFFF read, in that order, from the zip64 field of the entry's ``extra`` bytes."""
    at = 0
    while at + 4 <= len(extra):
        field, length = struct.unpack_from("<2H", extra, at)
        if field == 0x0001:
            data, read = extra[at + 4 : at + 4 + length], 0
            for index, value in enumerate(values):
                if value == _UNSET32:
                    if read + 8 > len(data):
                        raise _Refused("a zip64 field is shorter than its entry needs")
                    values[index] = struct.unpack_from("<Q", data, read)[0]
                    read += 8
            return values
        at += 4 + length
    raise _Refused("an entry declares a zip64 size with no zip64 field")


def stored_members(read_at: ReadAt, size: int) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Each member of the zip archive of ``size`` bytes, by its name in lower case (miniz looks names up
    ignoring case: two that differ only in case are refused, and so is a NUL in a name), in directory
    order, as torch's reader sees it: the offset and size of its stored bytes; and the members' exact
    names in that order. :class:`_Refused` for anything ``torch.save`` does not write."""
    entries, offset, length = _directory(read_at, size)
    directory = read_at(offset, length)
    members: dict[str, tuple[int, int]] = {}
    exact_names: list[str] = []
    at = 0
    for number in range(entries):
        if at + _ENTRY.size > length or directory[at : at + 4] != b"PK\x01\x02":
            raise _NotArchive(f"its directory entry {number} is broken")
        fields = _ENTRY.unpack_from(directory, at)
        flags, method, compressed, declared, name_length, extra_length = fields[3], fields[4], *fields[8:12]
        comment_length, disk, local = fields[12], fields[13], fields[16]
        name_end = at + _ENTRY.size + name_length
        name = directory[at + _ENTRY.size : name_end].decode("utf-8", "replace")
        extra = directory[name_end : name_end + extra_length]
        at = name_end + extra_length + comment_length
        if at > length:
            raise _NotArchive(f"its directory entry {number} runs past the directory")
        if _UNSET32 in (declared, compressed, local):
            declared, compressed, local = _zip64_values(extra, [declared, compressed, local])
        if method != 0 or compressed != declared:
            raise _Refused(
                f"member {name!r} is compressed ({describe_size(compressed)} declaring "
                f"{describe_size(declared)}); torch.save stores members uncompressed"
            )
        if flags & 1 or disk:
            raise _Refused(f"member {name!r} is encrypted or on another disk")
        if "\0" in name:
            raise _Refused(f"member {name!r} has a NUL in its name (torch's reader stops the name there)")
        if name.lower() in members:
            raise _Refused(f"it names member {name!r} twice (ignoring case, as torch's reader does)")
        header = _LOCAL.unpack(read_at(local, _LOCAL.size))
        if header[0] != b"PK\x03\x04":
            raise _Refused(f"member {name!r} has no local header at byte {local}")
        start = local + _LOCAL.size + header[9] + header[10]
        if start + declared > offset:
            raise _Refused(
                f"member {name!r} ({describe_size(declared)}) runs past the start of the directory"
            )
        members[name.lower()] = (start, declared)
        exact_names.append(name)
    if at != length:
        raise _Refused(f"its directory holds {length - at} bytes after its {entries} entries")
    declared_total = sum(count for _, count in members.values())
    if declared_total > size:
        raise _Refused(
            f"its members declare {describe_size(declared_total)} in a file of {describe_size(size)}"
        )
    spans = sorted(members.values())
    if any(start < previous + count for (previous, count), (start, _) in zip(spans, spans[1:], strict=False)):
        raise _Refused("two of its members overlap")
    return members, exact_names


def _effect(opcode: pickletools.OpcodeInfo) -> tuple[bool, int, int]:
    """``(takes a mark, entries it pops above the mark, entries it pushes)`` of a pickle ``opcode``."""
    before = opcode.stack_before
    marked = pickletools.markobject in before
    return (
        marked,
        len(before[: before.index(pickletools.markobject)] if marked else before),
        len(opcode.stack_after),
    )


_EFFECTS = {opcode.name: _effect(opcode) for opcode in pickletools.opcodes}


class _Entry(NamedTuple):
    """What the scan follows of a stack entry: the depth of the tuple it would be (0: not a tuple), and the
    text of a string or the entries of a tuple (None: anything else)."""

    depth: int = 0
    value: Any = None


_OTHER = _Entry()
_STRINGS = frozenset({"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})


def _storage_key(pid: _Entry) -> str | None:
    """The key of a ``torch.save`` persistent id ``("storage", type, key, location, numel)``, else None."""
    items = pid.value if isinstance(pid.value, tuple) else ()
    return items[2].value if len(items) == 5 and isinstance(items[2].value, str) else None


def check_pickle(data: bytes, storages: frozenset[str] | None = None) -> None:
    """:class:`_Refused` unless the pickle ``data`` has at most :data:`PICKLE_OPCODES` opcodes, at most
    :data:`PICKLE_OBJECTS` of them building or memoizing something, and tuples and frozensets nested at most
    :data:`MAX_NESTING` deep; with ``storages`` (the exact names of the archive's members in its ``data/``
    folder), each storage it refers to (``BINPERSID``) by one of those names exactly. torch reads a storage
    once per key, and its reader finds a member ignoring case and up to a NUL: keys that differ only so
    would read one member many times. Scanned, never loaded: each stack entry is followed as an
    :class:`_Entry`, through the memo too."""
    stack: list[_Entry] = []
    marks: list[int] = []
    memo: dict[Any, _Entry] = {}
    builds = 0
    try:
        for count, (opcode, arg, _) in enumerate(pickletools.genops(io.BytesIO(data)), start=1):
            if count > PICKLE_OPCODES:
                raise _Refused(f"its data.pkl runs past {PICKLE_OPCODES} opcodes")
            name = opcode.name
            if name in _BUILDS:
                builds += 1
                if builds > PICKLE_OBJECTS:
                    raise _Refused(f"its data.pkl builds or stores more than {PICKLE_OBJECTS} objects")
                if name in _MEMO_PUT:
                    memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
                    continue
                if name in _TUPLES:
                    taken = _TUPLES[name]
                    start = marks.pop() if taken is None else len(stack) - taken
                    depth = 1 + max((entry.depth for entry in stack[start:]), default=0)
                    if depth > MAX_NESTING:
                        raise _Refused(f"its data.pkl nests tuples more than {MAX_NESTING} deep")
                    stack[start:] = [_Entry(depth, tuple(stack[start:]))]
                    continue
                if storages is not None and name in ("PERSID", "BINPERSID"):
                    key = _storage_key(stack[-1]) if name == "BINPERSID" and stack else None
                    if key not in storages:
                        raise _Refused(
                            f"its data.pkl refers to a storage {key!r} that is no member of its data/ "
                            "folder by that exact name"
                        )
            elif name in _MEMO_GET:
                stack.append(memo.get(arg, _OTHER))
                continue
            elif name in _STRINGS:
                stack.append(_Entry(0, arg))
                continue
            elif name == "MARK":
                marks.append(len(stack))
                continue
            elif name == "DUP":
                stack.append(stack[-1])
                continue
            marked, pops, pushes = _EFFECTS[name]
            if marked:
                del stack[marks.pop() :]
            if pops:
                if pops > len(stack):
                    raise _Refused(f"its data.pkl takes from an empty stack ({name})")
                del stack[-pops:]
            if pushes:  # one entry: DUP, the only opcode pushing two, is followed above
                stack.append(_OTHER)
    except (ValueError, IndexError) as exc:
        if isinstance(exc, _Refused):
            raise
        raise _Refused(f"its data.pkl is not a pickle ({exc})") from None


def open_checkpoint(path: str | Path, what: str = "checkpoint") -> IO[bytes]:
    """The regular file ``path`` opened for ``torch.load``, once checked as this module says; a one-line
    :class:`~mlcls.io.UnsafeFileError` naming the file otherwise."""
    file = open_regular(path, "rb", max_bytes=CAPS["checkpoint"], what=what)
    try:
        size = file.raw.declared
        read_at = _reader(file, size)
        members, names = stored_members(read_at, size)
        folder = names[0].partition("/")[0] if names else ""  # torch reads <its first member's folder>/...
        pickle_name = f"{folder}/data.pkl".lower()
        if pickle_name in members:
            start, count = members[pickle_name]
            cap = CAPS["checkpoint pickle"]
            if count > cap:
                raise _Refused(
                    f"its data.pkl is {describe_size(count)}; at most {describe_size(cap)} expected"
                )
            data = f"{folder}/data/"
            storages = frozenset(name[len(data) :] for name in names if name.startswith(data))
            check_pickle(read_at(start, count), storages)
        file.seek(0)
        return file
    except _NotArchive as exc:
        file.close()
        raise UnsafeFileError(
            f"{path} is not a {what} written by torch.save (not a zip archive as torch reads it: {exc})"
        ) from None
    except _Refused as exc:
        file.close()
        raise UnsafeFileError(f"{path}: {exc}") from None
    except BaseException:
        file.close()
        raise


_CONTAINERS = (dict, list, tuple, set, frozenset)


def _contents(node: Any) -> list[Any]:
    """The containers directly inside the container ``node`` (a dict's keys and values)."""
    items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
    return [item for item in items if isinstance(item, _CONTAINERS)]


def check_nesting(data: Any, where: str, limit: int = MAX_NESTING) -> None:
    """:class:`~mlcls.io.UnsafeFileError` if the dicts, lists, tuples and sets of ``data`` (read from
    ``where``) nest more than ``limit`` deep along any path or contain themselves: what a recursive walk (a
    deep copy, OmegaConf) would meet, found without recursion, each container walked once."""
    if not isinstance(data, _CONTAINERS):
        return
    height: dict[int, int] = {}  # id of a container walked -> containers on its longest path down
    path = [(data, iter(_contents(data)))]
    on_path = {id(data)}
    while path:
        node, contents = path[-1]
        child = next(contents, None)
        if child is None:
            path.pop()
            on_path.discard(id(node))
            height[id(node)] = 1 + max((height[id(inner)] for inner in _contents(node)), default=0)
            continue
        if id(child) in on_path:
            raise UnsafeFileError(f"{where} holds a container that contains itself")
        if id(child) not in height:
            path.append((child, iter(_contents(child))))
            on_path.add(id(child))
        if len(path) + height.get(id(child), 0) > limit:
            raise UnsafeFileError(
                f"{where} nests containers more than {limit} deep; at most {limit} expected"
            )
