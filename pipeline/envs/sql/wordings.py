"""A compositional grammar of the analyst's questions: dozens of wordings per family for train and validation.

Five fixed wordings per family are too few: a policy trained on four of them reads the held-out fifth (test only) as
a different question (held-out wording 0.40 against 0.72 on the seen ones, docs/env-sql.md). Train and validation
questions are therefore drawn from a grammar around the training wordings. A question is

    opener + frame + closer

- the **frame** is one of the family's sentence patterns: the fixed training wordings (``Family.wordings[0:4]``, ids
  kept) and the frames below, interrogative and imperative, with the filters in either order;
- an optional **opener** (a greeting, "could you" turning an order into a question) and **closer** (thanks, what the
  figure is for) surround it.

Values stay in single quotes exactly as the SQL writes them, as in the fixed wordings, so the token before a value
is the same in the question and in the query (:mod:`pipeline.envs.sql.tasks`).

**The held-out wording stays held out.** Test draws from the five fixed wordings, index 4 of which no training task
uses. No frame writes the held-out wording, nor its construction: the fronted place or month ("In 'Lyon', ...",
"For '2023-04', ..."), the two clauses joined by a semicolon ("Customers in ... placed orders; how many of those
..."), the fronted participle ("Taking ...", "Summing ..."), "Across ...", "Of the ... products", "Rank ... and give
the first", and the held-out phrases "combined", "altogether", "hold together", "more expensive than", "the
maximum", "whose status is", "give the count" (``tests/test_env_sql_wordings.py`` checks every surface form).

Template ids: a fixed training wording keeps its id (``count_customers/2``); grammar frame k of a family has id
``<family>/<5 + k>``. Openers and closers do not change the id, so ids count sentence patterns.
"""

from __future__ import annotations

import itertools

import numpy as np

from pipeline.envs import wordings as grammar

GRAMMAR_BASE = 5  # template ids from here on are grammar frames (0-4 are the fixed wordings; 4 is held out)

OPENERS = ("", "", "", "", "Hi, ", "Hello, ", "Quick question: ", "For the report: ", "Hey, ", "One more: ")
IMPERATIVE_OPENERS = ("", "", "Please ", "Could you ", "Can you ", "Kindly ")
CLOSERS = ("", "", "", "", " Thanks.", " Thank you!", " Thanks in advance.", " I need it for a report.",
           " It is for the dashboard.", " Please check the data.")
FIXED_OPENERS = ("", "Hi, ", "Hello, ", "Quick question: ")  # those that leave a fixed wording a sentence

# Frames: (text, imperative), with the slots of the family's fixed wordings.
FRAMES: dict[str, tuple[tuple[str, bool], ...]] = {
    "count_customers": (
        ("how many customers in '{city}' are '{segment}' customers?", False),
        ("what is the count of '{segment}' customers located in '{city}'?", False),
        ("how many customers does '{city}' have in the '{segment}' segment?", False),
        ("what number of '{city}' customers have the segment '{segment}'?", False),
        ("count how many customers from '{city}' are in segment '{segment}'.", True),
        ("tell me the number of '{segment}' customers in '{city}'.", True),
        ("find the number of customers in city '{city}' and segment '{segment}'.", True),
        ("I'd like to know how many '{segment}' customers live in '{city}'.", False),
    ),
    "count_orders_range": (
        ("how many '{status}' orders are dated between '{d1}' and '{d2}'?", False),
        ("what is the number of orders with status '{status}' from '{d1}' to '{d2}'?", False),
        ("how many orders in status '{status}' fall between '{d1}' and '{d2}'?", False),
        ("from '{d1}' to '{d2}', how many orders had status '{status}'?", False),
        ("count the orders placed from '{d1}' to '{d2}' that have status '{status}'.", True),
        ("tell me how many orders between '{d1}' and '{d2}' have status '{status}'.", True),
        ("find the number of '{status}' orders placed between '{d1}' and '{d2}'.", True),
        ("I'd like the number of '{status}' orders dated '{d1}' through '{d2}'.", False),
    ),
    "count_products": (
        ("how many products in '{category}' have a price above {threshold}?", False),
        ("what is the count of '{category}' products priced over {threshold}?", False),
        ("how many products with category '{category}' cost above {threshold}?", False),
        ("what number of '{category}' products have prices above {threshold}?", False),
        ("count the '{category}' products that cost over {threshold}.", True),
        ("tell me how many '{category}' products are priced higher than {threshold}.", True),
        ("find the number of products in the '{category}' category with a price greater than {threshold}.", True),
        ("I'd like to know how many '{category}' products cost more than {threshold}.", False),
    ),
    "revenue_month": (
        ("what is the sum of the totals of '{status}' orders in '{month}'?", False),
        ("what was the total of all '{status}' orders in '{month}'?", False),
        ("how much were the '{status}' orders from '{month}' worth in total?", False),
        ("how much revenue did '{status}' orders bring in '{month}'?", False),
        ("add up the totals of the '{status}' orders placed in '{month}'.", True),
        ("tell me the total value of orders with status '{status}' in '{month}'.", True),
        ("calculate the sum of order totals for '{status}' orders in '{month}'.", True),
        ("I'd like the total of the '{status}' orders placed during '{month}'.", False),
    ),
    "avg_order_month": (
        ("what was the average order total for '{channel}' orders in '{month}'?", False),
        ("how big was the average '{channel}' order in '{month}'?", False),
        ("what did a '{channel}' order in '{month}' total on average?", False),
        ("what is the mean order total of orders via the '{channel}' channel in '{month}'?", False),
        ("calculate the average total of orders from the '{channel}' channel in '{month}'.", True),
        ("tell me the average order total of '{channel}' orders during '{month}'.", True),
        ("give me the average of order totals for channel '{channel}' in '{month}'.", True),
        ("I'd like the average total of '{channel}' orders placed in '{month}'.", False),
    ),
    "stock_category": (
        ("how many '{category}' items priced over {threshold} are in stock in total?", False),
        ("how much stock do we have of '{category}' products costing over {threshold}?", False),
        ("what is the stock total of '{category}' products with prices above {threshold}?", False),
        ("what is the summed stock of products in '{category}' priced higher than {threshold}?", False),
        ("add up the stock of '{category}' products with a price above {threshold}.", True),
        ("tell me the total stock of products in '{category}' that cost over {threshold}.", True),
        ("calculate the sum of stock for '{category}' products priced higher than {threshold}.", True),
        ("I'd like to know the total stock of '{category}' products above a price of {threshold}.", False),
    ),
    "orders_city_status": (
        ("how many '{status}' orders come from customers in '{city}'?", False),
        ("what is the number of orders with status '{status}' by customers living in '{city}'?", False),
        ("how many orders placed by '{city}' customers have the status '{status}'?", False),
        ("what count of '{status}' orders belongs to customers from '{city}'?", False),
        ("count the orders of '{city}' customers that have status '{status}'.", True),
        ("tell me how many orders from '{city}' customers are '{status}'.", True),
        ("find the number of '{status}' orders placed by a customer in '{city}'.", True),
        ("I'd like the number of '{status}' orders made by customers in '{city}'.", False),
    ),
    "revenue_city_month": (
        ("what did customers from '{city}' spend on orders in '{month}'?", False),
        ("how much was ordered by '{city}' customers during '{month}', in total?", False),
        ("what is the sum of order totals in '{month}' for customers from '{city}'?", False),
        ("what was the total order value of '{city}' customers in '{month}'?", False),
        ("add up the order totals of customers in '{city}' for '{month}'.", True),
        ("tell me the total value of '{month}' orders by customers in '{city}'.", True),
        ("calculate the total of orders placed in '{month}' by '{city}' customers.", True),
        ("I'd like the total of the '{month}' orders of customers in '{city}'.", False),
    ),
    "units_category_month": (
        ("what is the total quantity of '{category}' products ordered in '{month}'?", False),
        ("how many '{category}' units did customers order in '{month}'?", False),
        ("how many units of products in the '{category}' category appear on '{month}' orders?", False),
        ("what number of units in category '{category}' were ordered in '{month}'?", False),
        ("add up the units of '{category}' products on orders from '{month}'.", True),
        ("tell me how many units of '{category}' products were ordered during '{month}'.", True),
        ("calculate the units of '{category}' products sold in '{month}'.", True),
        ("I'd like the number of '{category}' units ordered in '{month}'.", False),
    ),
    "top_products": (
        ("what are the {k} '{category}' products with the highest {mw}, best first?", False),
        ("which '{category}' products are the top {k} by {mw}?", False),
        ("which {k} products in '{category}' lead by {mw}, from the top?", False),
        ("show the top {k} '{category}' products by {mw}, highest first.", True),
        ("give me the {k} best '{category}' products by {mw}, in order.", True),
        ("list the top {k} products of category '{category}' by {mw}.", True),
        ("tell me which {k} '{category}' products have the most {mw}, from the top.", True),
        ("I'd like the top {k} '{category}' products by {mw}, in descending order.", False),
    ),
    "top_customers": (
        ("what are the {k} customers in '{city}' with the highest {mw}, best first?", False),
        ("which '{city}' customers are the top {k} by {mw}?", False),
        ("which {k} customers from '{city}' lead by {mw}, from the top?", False),
        ("show the top {k} customers of '{city}' by {mw}, highest first.", True),
        ("give me the {k} best '{city}' customers by {mw}, in order.", True),
        ("list the top {k} customers located in '{city}' by {mw}.", True),
        ("tell me which {k} '{city}' customers have the largest {mw}, from the top.", True),
        ("I'd like the top {k} customers in '{city}' by {mw}, in descending order.", False),
    ),
    "top_products_month": (
        ("what are the {k} products with the highest order value in '{month}', best first?", False),
        ("which products were the top {k} by order value in '{month}'?", False),
        ("which {k} products led by order value during '{month}', from the top?", False),
        ("show the top {k} products by order value for '{month}', highest first.", True),
        ("give me the {k} best products of '{month}' by order value, in order.", True),
        ("list the top {k} products in '{month}' by order value.", True),
        ("tell me which {k} products had the most order value in '{month}', from the top.", True),
        ("I'd like the top {k} products by order value in '{month}', in descending order.", False),
    ),
    "max_spend": (
        ("what is the highest total any one customer in '{city}' spent on '{status}' orders?", False),
        ("what is the largest amount one '{city}' customer spent on '{status}' orders?", False),
        ("how much did the top-spending customer in '{city}' spend on '{status}' orders?", False),
        ("what is the top sum of '{status}' orders by a single customer located in '{city}'?", False),
        ("find the highest per-customer total of '{status}' orders in '{city}'.", True),
        ("tell me the biggest total that one customer from '{city}' has in '{status}' orders.", True),
        ("give me the highest per-customer sum of '{status}' orders among customers in '{city}'.", True),
        ("I'd like the largest total of '{status}' orders placed by one '{city}' customer.", False),
    ),
}


def frames_of(family: str, fixed: tuple[str, ...], template_ids: list[int]) -> list[tuple[int, str, bool, bool]]:
    """(template id, text, imperative, is_fixed) of every frame a family's question may take."""
    return grammar.frames_of(fixed, template_ids, FRAMES[family], GRAMMAR_BASE)


def render(frame: str, imperative: bool, is_fixed: bool, slots: dict, opener: str, closer: str) -> str:
    """One question: `frame` with `slots`, after `opener` and before `closer`. "Could you"/"Can you" turn an order
    into a question; a fixed wording takes only the openers of :data:`FIXED_OPENERS`."""
    text = frame.format(**slots)
    if is_fixed:
        if opener in FIXED_OPENERS and opener and text[:1].isalpha():
            text = opener + text[:1].lower() + text[1:]
        return text + closer
    if opener in ("Could you ", "Can you ") and text.endswith("."):
        text = text[:-1] + "?"
    text = text[:1].upper() + text[1:]
    if opener and text[:1].isalpha() and not text.startswith("I'"):
        text = opener + text[:1].lower() + text[1:]
    return text + closer


def draw(family: str, slots: dict, template_ids: list[int], fixed: tuple[str, ...], rng: np.random.Generator,
         frame: int | None = None) -> tuple[str, int]:
    """(question, template id) for `slots`: a frame drawn uniformly from the fixed wordings `template_ids` (texts
    in `fixed`) and the family's grammar frames, then an opener and a closer. `frame` (an index into the family's
    grammar frames) draws that frame alone; with one fixed wording in `template_ids` and `frame` None, that one."""
    tid, text, imperative, is_fixed = grammar.choose_frame(frames_of(family, fixed, template_ids),
                                                           len(template_ids), frame, rng)
    opener = grammar.pick(IMPERATIVE_OPENERS if imperative else OPENERS, rng)
    return render(text, imperative, is_fixed, slots, opener, grammar.pick(CLOSERS, rng)), tid


def surface_forms(family: str, slots: dict, fixed: tuple[str, ...], template_ids: list[int]) -> set[str]:
    """Every question :func:`draw` can write for `slots` (every frame, opener and closer)."""
    out: set[str] = set()
    for _, text, imperative, is_fixed in frames_of(family, fixed, template_ids):
        for opener, closer in itertools.product(set(IMPERATIVE_OPENERS if imperative else OPENERS), set(CLOSERS)):
            out.add(render(text, imperative, is_fixed, slots, opener, closer))
    return out
