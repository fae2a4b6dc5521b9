"""The one reader of fmattn decks for the scripts (imported from the scripts' own folder; stdlib
only): a deck file, the resolved deck `fmattn --check` prints, or the `deck` attribute of a run's
HDF5 files, plus --set overrides, read as fmattn reads them (SPEC section 3).

A deck is INI text: [section] lines and `key = value` lines (`:` separates too, as in inih);
`;` and `#` start a comment at the start of a line or after a space; an indented line is an
ordinary line (not the continuation of a value); keys are case-sensitive. A setting is named
"section.key" ("attention.fma.m"). --set items ("section.key=value") come after the deck, the
last one winning, as on fmattn's command line.
"""
import configparser


def deck_values(text="", sets=(), source="<deck>"):
    """{"section.key": "value"} of a deck's text in its order, then of each --set item of sets
    ("section.key=value"; an item without '=' is passed over). Raises configparser.Error, naming
    source, where the text is not a deck: a key before any [section], a line that is neither, a
    key or section given twice."""
    cp = configparser.ConfigParser(comment_prefixes=(";", "#"), inline_comment_prefixes=(";", "#"),
                                   interpolation=None)
    cp.optionxform = str  # keys as given: fmattn's are case-sensitive
    lines = str(text).removeprefix("\ufeff").split("\n")
    cp.read_string("\n".join(line.lstrip() for line in lines), source=source)
    values = {f"{s.strip()}.{k}": v for s in cp.sections() for k, v in cp[s].items()}
    for item in sets:
        if "=" in item:
            k, v = item.split("=", 1)
            values[k.strip()] = v.strip()
    return values


def read_deck(path, sets=()):
    """deck_values of a deck file; OSError where it cannot be read."""
    with open(path) as f:
        return deck_values(f.read(), sets, source=path)
