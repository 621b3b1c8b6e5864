"""A compositional grammar of shop questions: hundreds of wordings per family for train and validation.

Real users do not phrase a question one of four ways. With ``build_env.options.wordings: grammar`` (the default),
train and validation questions are drawn from this grammar instead of the four fixed training wordings. A question is

    opener + frame + closer

- the **frame** is one of the family's sentence patterns: the original training wordings
  (:data:`~pipeline.envs.shop.tasks.TRAIN_TEMPLATES`, ids kept) and the frames below, interrogative and imperative,
  with the entity first or last (word order);
- its slots take **synonyms**: field words (price, unit price, cost, ...), units (pounds, lbs, ...), quantity nouns
  (units of, pieces of, ...), and several ways to name a supplier's flagship product;
- an optional **opener** (greeting, politeness, "could you" turning an order into a question) and **closer**
  (thanks, an extra clause) surround it.

Each family's grammar yields several hundred distinct wordings per field (:func:`surface_forms` enumerates them;
``tests/test_wordings.py`` counts them).

**The held-out wording stays held out.** Test draws from the original five wordings, index 4 of which no training
task uses (``template_seen`` False). The grammar never produces it: :func:`surface_forms` of every family, with every
slot value, is checked in the tests not to contain the held-out wording's text. More than that, none of its frames
uses the held-out wording's construction (a fronted "For the product ...", "The supplier ... has a flagship
product; ...", "Taken together, what ... do ... have?", "If I order ..., what do I pay?", "the mass of one ...",
"Book an incoming shipment ... how many are in stock afterwards"). Words such as "mass", "shipment" or "its" do occur
in other frames, as they would in any natural grammar of these questions; the people who wrote the frames had seen the
held-out wordings, which is why the constructions, not only the exact text, are kept out.

Template ids: a question from an original training wording keeps that wording's id (``lookup/2``); a grammar frame k
of a family has id ``<family>/<9 + k>``. Openers and closers do not change the id, so ids count sentence patterns.
"""

from __future__ import annotations

import itertools

import numpy as np

from pipeline.envs import wordings as grammar

GRAMMAR_BASE = 9  # template ids from here on are grammar frames (0-8 are the fixed wordings of tasks.TEMPLATES)

FIELD_SYNONYMS = {
    "price": ("price", "unit price", "listed price", "cost"),
    "stock": ("stock", "stock level", "inventory", "stock count"),
    "supplier": ("supplier", "vendor"),
    "category": ("category", "product category"),
}
UNIT_SYNONYMS = {"lb": ("pounds", "lbs"), "g": ("grams",), "oz": ("ounces", "oz")}
QUANTITY_NOUNS = ("units of ", "pieces of ", "items of ", "")
FLAGSHIP_PHRASES = (
    "the flagship product of {S}",
    "the flagship product from {S}",
    "the flagship item of {S}",
    "the flagship product made by {S}",
    "{S}'s flagship product",
    "the flagship of supplier {S}",
)
OPENERS = ("", "", "", "", "Hi, ", "Hello, ", "Quick question: ", "Hey, ", "Excuse me, ", "Good morning! ")
IMPERATIVE_OPENERS = ("", "", "Please ", "Could you ", "Can you ", "Kindly ")
CLOSERS = ("", "", "", "", " Thanks.", " Thank you!", " Thanks in advance.", " I need it today.",
           " It is for an invoice.", " Please be quick.")

# Frames: (text, imperative). {F} field phrase, {P}/{Q} quoted products, {N} a count, {X} a quantity noun,
# {U} a unit, {FP} a flagship phrase (which names the quoted supplier {S}).
FRAMES: dict[str, tuple[tuple[str, bool], ...]] = {
    "lookup": (
        ("what's the {F} of {P}?", False),
        ("what is {P}'s {F}?", False),
        ("do you know the {F} of {P}?", False),
        ("which {F} is listed for {P}?", False),
        ("what {F} is recorded for {P}?", False),
        ("give me the {F} of {P}.", True),
        ("check the {F} for {P}.", True),
        ("get me the {F} of {P}.", True),
        ("show me the {F} of {P}.", True),
        ("report the {F} of {P}.", True),
        ("{P}: what is the {F}?", False),
        ("regarding {P}, what is the {F}?", False),
        ("about {P} - what {F} does it have?", False),
        ("I'd like to know the {F} of {P}.", False),
    ),
    "lookup_calc": (
        ("how much do {N} {X}{P} cost?", False),
        ("what do {N} {X}{P} cost altogether?", False),
        ("what will I pay for {N} {X}{P}?", False),
        ("what is the cost of buying {N} {X}{P}?", False),
        ("what is {N} times the price of {P}?", False),
        ("calculate the price of {N} {X}{P}.", True),
        ("give me the total for {N} {X}{P}.", True),
        ("price {N} {X}{P} for me.", True),
        ("work out the cost of {N} {X}{P}.", True),
        ("{N} {X}{P}: what is the total price?", False),
        ("I'd like to buy {N} {X}{P}; what does that cost?", False),
        ("for {N} {X}{P}, what is the total cost?", False),
    ),
    "lookup_convert": (
        ("how much does {P} weigh in {U}?", False),
        ("what is the weight of {P} in {U}?", False),
        ("what is the mass of {P} in {U}?", False),
        ("how many {U} does {P} weigh?", False),
        ("convert the weight of {P} into {U}.", True),
        ("give me the weight of {P} in {U}.", True),
        ("tell me how heavy {P} is, in {U}.", True),
        ("report the weight of {P} in {U}.", True),
        ("{P}: how heavy is it in {U}?", False),
        ("in {U}, how much does {P} weigh?", False),
        ("I'd like the weight of {P} in {U}.", False),
    ),
    "search_lookup": (
        ("what's the {F} of {FP}?", False),
        ("do you know the {F} of {FP}?", False),
        ("which {F} is listed for {FP}?", False),
        ("give me the {F} of {FP}.", True),
        ("check the {F} of {FP}.", True),
        ("report the {F} of {FP}.", True),
        ("search for {FP} and tell me its {F}.", True),
        ("regarding {FP}, what is the {F}?", False),
        ("I'd like to know the {F} of {FP}.", False),
    ),
    "two_lookup": (
        ("what is the sum of the {F} of {P} and {Q}?", False),
        ("what is the {F} of {P} plus the {F} of {Q}?", False),
        ("how much is the {F} of {P} and {Q} combined?", False),
        ("calculate the combined {F} of {P} and {Q}.", True),
        ("give me the total {F} of {P} and {Q}.", True),
        ("add the {F} of {P} to the {F} of {Q}.", True),
        ("tell me the {F} of {P} and {Q} combined.", True),
        ("{P} and {Q}: what is their total {F}?", False),
        ("I'd like the combined {F} of {P} and {Q}.", False),
    ),
    "update": (
        ("{N} {X}{P} just arrived; update the stock and report the new stock.", True),
        ("record {N} additional {X}{P} in stock and give the updated stock.", True),
        ("raise the stock of {P} by {N} and tell me the new stock.", True),
        ("a shipment of {N} {X}{P} came in: add it to the stock and report the new stock.", True),
        ("update the stock of {P}: {N} more arrived. What is the new stock?", False),
        ("add {N} {X}{P} to the inventory and tell me the new stock level.", True),
        ("we got {N} more {X}{P}; please update its stock and tell me the result.", False),
        ("restock {N} {X}{P} and report the updated stock.", True),
    ),
    "search_lookup_calc": (
        ("how much do {N} {X}{FP} cost?", False),
        ("what will I pay for {N} {X}{FP}?", False),
        ("what is the cost of buying {N} {X}{FP}?", False),
        ("calculate the price of {N} {X}{FP}.", True),
        ("give me the total for {N} {X}{FP}.", True),
        ("work out the cost of {N} {X}{FP}.", True),
        ("I'd like to buy {N} {X}{FP}; what does that cost?", False),
        ("for {N} {X}{FP}, what is the total cost?", False),
    ),
}


SLOT_CHOICES = {"F": lambda s: FIELD_SYNONYMS[s["field"]], "U": lambda s: UNIT_SYNONYMS[s["unit"]],
                "X": lambda s: QUANTITY_NOUNS, "FP": lambda s: FLAGSHIP_PHRASES}
FIXED_OPENERS = ("", "Hi, ", "Hello, ", "Quick question: ")  # those that leave a fixed wording a sentence


def frames_of(family: str, fixed: tuple[str, ...], template_ids: list[int]) -> list[tuple[int, str, bool, bool]]:
    """(template id, text, imperative, is_fixed) of every frame a family's question may take."""
    return grammar.frames_of(fixed, template_ids, FRAMES[family], GRAMMAR_BASE)


def render(frame: str, imperative: bool, is_fixed: bool, slots: dict, choice: dict, opener: str, closer: str) -> str:
    """One question: `frame` with `slots` (the task's values) and `choice` (a synonym per slot key of
    :data:`SLOT_CHOICES`), after `opener` and before `closer`. "Could you"/"Can you" turn an order into a question;
    a fixed wording takes only the openers of :data:`FIXED_OPENERS`."""
    if is_fixed:
        text = frame.format(**slots)
        if opener in FIXED_OPENERS and opener and text[:1].isalpha():
            text = opener + text[:1].lower() + text[1:]
        return text + closer
    values = dict(choice)
    if "FP" in values:
        values["FP"] = values["FP"].replace("{S}", f'"{slots["s"]}"')
    if values.get("X") == "" and values.get("FP", "").startswith("the "):  # "3 of the flagship ...", not "3 the ..."
        values["X"] = "of "
    for key, slot in (("P", "p"), ("Q", "q"), ("N", "n")):
        if "{" + key + "}" in frame:
            values[key] = f'"{slots[slot]}"' if key != "N" else str(slots[slot])
    text = frame.format(**values)
    if opener in ("Could you ", "Can you ") and text.endswith("."):
        text = text[:-1] + "?"
    text = text[:1].upper() + text[1:]
    if opener and text[:1].isalpha() and not text.startswith("I'"):
        text = opener + (text if opener.endswith("! ") else text[:1].lower() + text[1:])
    return text + closer


def _slot_keys(frame: str, is_fixed: bool) -> list[str]:
    return [] if is_fixed else [k for k in SLOT_CHOICES if "{" + k + "}" in frame]


def draw(family: str, slots: dict, template_ids: list[int], fixed: tuple[str, ...], rng: np.random.Generator,
         frame: int | None = None) -> tuple[str, int]:
    """(question, template id) for `slots` (the task's values, :func:`~pipeline.envs.shop.tasks._slots`): a frame
    drawn uniformly from the fixed wordings `template_ids` (texts in `fixed`) and the family's grammar frames, then a
    synonym for each of its slots, an opener and a closer. `frame` (an index into the family's grammar frames) draws
    that frame alone, or the one fixed wording of `template_ids` when it is None and `template_ids` has one."""
    pick = lambda seq: grammar.pick(seq, rng)  # noqa: E731
    tid, frame, imperative, is_fixed = grammar.choose_frame(frames_of(family, fixed, template_ids),
                                                            len(template_ids), frame, rng)
    choice = {k: pick(SLOT_CHOICES[k](slots)) for k in _slot_keys(frame, is_fixed)}
    opener = pick(IMPERATIVE_OPENERS if imperative else OPENERS)
    return render(frame, imperative, is_fixed, slots, choice, opener, pick(CLOSERS)), tid


def surface_forms(family: str, slots: dict, fixed: tuple[str, ...], template_ids: list[int]) -> set[str]:
    """Every question :func:`draw` can write for `slots` (every frame, synonym, opener and closer)."""
    out: set[str] = set()
    for _, frame, imperative, is_fixed in frames_of(family, fixed, template_ids):
        keys = _slot_keys(frame, is_fixed)
        for combo in itertools.product(*(SLOT_CHOICES[k](slots) for k in keys)):
            for opener in set(IMPERATIVE_OPENERS if imperative else OPENERS):
                for closer in set(CLOSERS):
                    out.add(render(frame, imperative, is_fixed, slots, dict(zip(keys, combo)), opener, closer))
    return out
