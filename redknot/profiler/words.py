"""Word lists from which calibration text is generated offline (no corpus, no download).

Plain English words and invented names, chosen so that sentences built from them read as
ordinary prose to a language model. Changing these lists changes every calibration prompt:
bump ``CALIBRATION_VERSION`` in ``calibration.py`` when you do.
"""

from __future__ import annotations


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ADJECTIVES = _words(
    "quiet golden ancient busy narrow bright gentle hollow silver distant humble crowded "
    "bitter calm careful clever cold curious dark early empty famous fierce fresh friendly "
    "green heavy hidden honest huge kind large late little lively lonely loud lucky modern "
    "muddy noble odd old patient plain polite proud quick rare red rich rough round rusty "
    "sharp shy simple slow small smooth soft steady strange strong sudden sweet tall tidy "
    "tiny warm weary wide wild wise wooden young"
)

NOUNS = _words(
    "river garden window market teacher island engine harbor lantern meadow village mirror "
    "bridge forest candle castle ocean valley tower painter baker farmer sailor doctor "
    "library station kitchen orchard theater museum factory school bakery temple hill lake "
    "road street wagon ship train clock bell letter map book table chair door roof wall "
    "field stone cloud storm winter summer morning evening festival council merchant "
    "soldier student writer singer pilot captain driver gardener carpenter tailor miller "
    "shepherd hunter fisher weaver potter smith judge mayor nurse clerk guard"
)

VERBS = _words(
    "watched crossed painted followed carried repaired visited guarded opened described "
    "cleaned counted built measured moved lifted found lost noticed remembered sold bought "
    "borrowed returned explored crossed decorated examined finished greeted helped joined "
    "locked marked ordered packed planted pulled pushed reached saved searched shared "
    "signed studied touched traded trusted turned used warned washed wrapped"
)

PLACES = _words(
    "Ardell Brenmoor Caldera Dunhollow Eastwick Fallowmere Glenrock Harrowgate Ironvale "
    "Juniper Kestrel Lowmarsh Millbrook Northcliff Oakhaven Pinecrest Quarrybend Redwater "
    "Stonebridge Thornbury Umberfield Valewood Westmarch Yarrowby Zephyr Ashford Brightwater "
    "Coldspring Deepdale Elmstead Foxhollow Greywell Highmoor Ivybridge"
)

FIRST_NAMES = _words(
    "Alice Bruno Clara Diego Elena Felix Greta Hugo Irene Jonas Karla Lukas Marta Nico Olga "
    "Pavel Quentin Rosa Stefan Tilda Ulrich Vera Walter Xenia Yusuf Zora Anton Bianca Carlos "
    "Dora Emil Fiona Gustav Hanna Ivan Julia Konrad Lena Milo Nora Oskar Petra Rafael Sara "
    "Tomas Una Viktor Wanda"
)

FAMILY_NAMES = _words(
    "Abbott Baxter Carver Dalton Ellison Fletcher Garrett Holloway Ingram Jarvis Keller "
    "Lambert Mercer Norwood Oakley Prescott Quinlan Radford Sutton Thatcher Underwood Vance "
    "Whitaker Yates Zimmer"
)

OBJECTS = _words(
    "key compass ledger lantern violin telescope medallion notebook crown chalice map "
    "hourglass ring statue banner scroll"
)

COLOURS = _words("red blue green yellow purple orange white black grey brown silver golden")
