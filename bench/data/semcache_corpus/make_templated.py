#!/usr/bin/env python3
"""Generate bench/data/semcache_corpus/templated.jsonl -- templated pairs for
evaluating a semantic cache (may prompt `b` be served the cached answer of `a`?).

Deterministic, stdlib only, no network: random.Random(2611) drives every choice
and no set/dict iteration depends on string hashing, so re-running the script
rewrites a byte-identical file.

How it is built
---------------
* A small grammar per domain: every base question ``B(...)`` has
  - ``q``: several question frames that mean exactly the same thing
    (the hand-written, meaning-preserving paraphrases of that question),
  - ``r``: request / imperative frames with the same meaning,
  - an optional condition / prepositional ``clause`` that can sit at the end
    or be moved to the front,
  - slots: ``E`` (enumerated values; a trap kind says what swapping the value
    means), ``N`` (numbers, rendered as digits or words) and ``Swap`` (two
    slots whose values are exchanged: direction or role swap).
* Hits keep every slot and change only the surface: paraphrase frame,
  British/American spelling, digits vs number words, politeness, a typo,
  clause order, question vs request, casing/punctuation.
* Traps keep the surface and change exactly one slot in a way that changes
  the correct answer (antonym, negation, direction, scope, entity, number,
  role swap, specificity).
* Optional greetings and answer-neutral context sentences wrap both sides.

Usage: python3 make_templated.py [--out PATH]
"""
import argparse
import collections
import json
import os
import random
import re

SEED = 2611
PER_KIND = 60  # pairs kept per kind (16 kinds -> 960 pairs)

DOMAINS = ["banking", "travel", "health", "cooking", "software", "retail",
           "telecom", "education", "government", "fitness", "science",
           "programming"]
HIT_KINDS = ["paraphrase", "spelling", "numeral", "politeness", "typo",
             "reorder", "request_form", "casing_punctuation"]
TRAP_KINDS = ["antonym", "negation", "direction", "scope", "entity", "number",
              "role_swap", "specificity"]


# --------------------------------------------------------------------------
# numbers
# --------------------------------------------------------------------------
ONES = ("zero one two three four five six seven eight nine ten eleven twelve "
        "thirteen fourteen fifteen sixteen seventeen eighteen nineteen").split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
ORD_IRREG = {"one": "first", "two": "second", "three": "third",
             "five": "fifth", "eight": "eighth", "nine": "ninth",
             "twelve": "twelfth"}


def num_words(n):
    if n < 20:
        return ONES[n]
    if n < 100:
        t, o = divmod(n, 10)
        return TENS[t] + ("-" + ONES[o] if o else "")
    if n < 1000:
        h, r = divmod(n, 100)
        return ONES[h] + " hundred" + (" " + num_words(r) if r else "")
    th, r = divmod(n, 1000)
    return num_words(th) + " thousand" + (" " + num_words(r) if r else "")


def ord_words(n):
    w = num_words(n)
    head, sep, last = w.rpartition("-") if "-" in w else w.rpartition(" ")
    if last in ORD_IRREG:
        last = ORD_IRREG[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last = last + "th"
    return head + sep + last


def ord_digits(n):
    if 10 <= n % 100 <= 20:
        suf = "th"
    else:
        suf = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return "%d%s" % (n, suf)


# --------------------------------------------------------------------------
# slot types
# --------------------------------------------------------------------------
class E:
    """Enumerated slot. kind=None: free variation only (no trap).
    Values may be dicts: their keys become template fields.
    groups: values whose answers coincide; a trap picks another group.
    specificity: values[0] is the general form, the others are narrower."""

    def __init__(self, kind, values=None, groups=None):
        self.kind = kind
        if groups:
            self.values = [v for g in groups for v in g]
            self.group = [gi for gi, g in enumerate(groups) for _ in g]
        else:
            self.values = list(values)
            self.group = list(range(len(self.values)))

    def pick(self, rng):
        return rng.randrange(len(self.values))

    def alt(self, rng, i):
        if self.kind == "specificity":
            if i == 0:
                return rng.randrange(1, len(self.values))
            return 0
        cands = [j for j in range(len(self.values))
                 if self.group[j] != self.group[i]]
        return rng.choice(cands)


class N:
    """Number slot, rendered as digits or words (ordinal optional)."""

    def __init__(self, values, kind="number", fmt=("{}", "{}"),
                 ordinal=False, words=True, group=True):
        self.values = list(values)
        self.group = group
        self.kind = kind
        self.fmt = fmt
        self.ordinal = ordinal
        self.words = words

    def pick(self, rng):
        return rng.randrange(len(self.values))

    def alt(self, rng, i):
        return rng.choice([j for j in range(len(self.values)) if j != i])

    def render(self, i, style):
        v = self.values[i]
        if style == "w" and self.words:
            return self.fmt[1].format(ord_words(v) if self.ordinal
                                      else num_words(v))
        return self.fmt[0].format(ord_digits(v) if self.ordinal
                                  else "{:,}".format(v) if self.group
                                  else str(v))


class Swap:
    """Two fields k1, k2 filled from fixed pairs (either orientation) or from
    a pool (two distinct values).  A trap of `kind` exchanges them; a trap of
    `alt` (entity) replaces one of them with another pool value."""

    def __init__(self, kind, k1, k2, pairs=None, pool=None, alt=None):
        self.kind, self.k1, self.k2 = kind, k1, k2
        self.pairs, self.pool, self.altkind = pairs, pool, alt

    def pick(self, rng):
        if self.pairs:
            x, y = rng.choice(self.pairs)
            if rng.random() < 0.5:
                x, y = y, x
            return [x, y]
        x, y = rng.sample(range(len(self.pool)), 2)
        return [self.pool[x], self.pool[y]]


BASES = []


class B:
    def __init__(self, domain, q, r=(), clause=None, slots=None, swaps=()):
        assert domain in DOMAINS
        self.domain, self.q, self.r = domain, list(q), list(r)
        self.clause = clause
        self.slots = dict(slots or {})
        self.swaps = list(swaps)
        BASES.append(self)

    # which trap kinds can be produced, with how to produce them
    def trap_ops(self):
        ops = collections.OrderedDict()
        for name, s in self.slots.items():
            if s.kind in TRAP_KINDS:
                ops.setdefault(s.kind, []).append(("slot", name))
        for si, sw in enumerate(self.swaps):
            ops.setdefault(sw.kind, []).append(("swap", si))
            if sw.altkind:
                ops.setdefault(sw.altkind, []).append(("swapalt", si))
        return ops

    def has_numeral(self):
        return any(isinstance(s, N) and s.words for s in self.slots.values())


# --------------------------------------------------------------------------
# the grammar: base questions per domain (American spelling in templates)
# --------------------------------------------------------------------------
MONEY = ("${}", "{} dollars")
PCT = ("{}%", "{} percent")
BANKS = ["Chase", "Wells Fargo", "Bank of America", "Citibank", "Capital One",
         "PNC"]

# ---- banking -------------------------------------------------------------
B("banking",
  q=["how do I {chg} the daily ATM withdrawal limit on my debit card",
     "what's the process to {chg} my debit card's daily ATM withdrawal limit",
     "is there a way to {chg} the daily ATM withdrawal limit on my debit card"],
  r=["explain how to {chg} the daily ATM withdrawal limit on my debit card",
     "walk me through how to {chg} my debit card's daily ATM withdrawal limit"],
  clause="while traveling abroad",
  slots={"chg": E("antonym", ["raise", "lower"])})
B("banking",
  q=["what fee does {bank} charge for an {dir} international wire transfer",
     "how much is {bank}'s fee for an {dir} international wire transfer",
     "what does {bank} charge me for an {dir} international wire transfer"],
  r=["tell me {bank}'s fee for an {dir} international wire transfer",
     "give me the fee {bank} charges for an {dir} international wire transfer"],
  slots={"bank": E("entity", BANKS),
         "dir": E("direction", ["incoming", "outgoing"])})
B("banking",
  q=["will I be charged interest on my credit card",
     "do I pay interest on my credit card purchases",
     "will my credit card company charge me interest"],
  r=["tell me whether I'll be charged interest on my credit card",
     "explain whether my credit card company will charge me interest"],
  clause="if I {pay} the full statement balance by the due date",
  slots={"pay": E("negation", ["pay", "don't pay"])})
B("banking",
  q=["what's the customer service phone number for {bank}",
     "what number do I call to reach {bank} customer service",
     "what phone number should I call for {bank} customer service"],
  r=["give me the customer service phone number for {bank}",
     "tell me which number to call for {bank} customer service"],
  clause="from outside the country",
  slots={"bank": E("entity", BANKS + ["HSBC", "Barclays"])})
B("banking",
  q=["how much interest will {amt} earn in one year in a savings account paying {rate} APY",
     "what's the yearly interest on {amt} in a savings account at {rate} APY",
     "how much interest does {amt} make over a year in a savings account at {rate} APY"],
  r=["calculate the interest {amt} earns in one year in a savings account at {rate} APY",
     "work out how much interest {amt} makes in a year in a savings account at {rate} APY"],
  slots={"amt": N([1000, 2000, 2500, 5000, 10000, 20000], fmt=MONEY),
         "rate": N([2, 3, 4, 5], fmt=PCT)})
B("banking",
  q=["is there a penalty for withdrawing money from my CD {sc} it matures",
     "will I pay a penalty if I take money out of my certificate of deposit {sc} it matures",
     "do I get charged a penalty for pulling funds out of a CD {sc} it matures"],
  r=["tell me if there's a penalty for withdrawing money from my CD {sc} it matures"],
  slots={"sc": E("scope", ["before", "after"])})
B("banking",
  q=["what documents do I need to open a checking account{spec}",
     "which documents are required to open a checking account{spec}",
     "what paperwork do I have to bring to open a checking account{spec}"],
  r=["list the documents I need to open a checking account{spec}",
     "tell me which documents are required to open a checking account{spec}"],
  slots={"spec": E("specificity", ["", " as an international student without a Social Security number"])})
B("banking",
  q=["can {x} add their {y} as an authorized user on a credit card",
     "is it possible for {x} to make their {y} an authorized user on a credit card",
     "can {x} put their {y} on a credit card as an authorized user"],
  r=["tell me whether {x} can add their {y} as an authorized user on a credit card"],
  slots={"who": E("role_swap", [{"x": "a parent", "y": "16-year-old"},
                                 {"x": "a 16-year-old", "y": "parent"}])})
B("banking",
  q=["what's the daily limit on how much cash I can {dw} at a {bank} ATM",
     "how much cash can I {dw} per day at a {bank} ATM",
     "what's the most cash I'm allowed to {dw} at a {bank} ATM in one day"],
  r=["tell me the daily limit on how much cash I can {dw} at a {bank} ATM"],
  slots={"dw": E("antonym", ["deposit", "withdraw"]),
         "bank": E("entity", BANKS)})
B("banking",
  q=["how do I stop a recurring charge {auth} on my credit card",
     "how can I get a recurring charge {auth} on my credit card stopped",
     "what do I do to stop a recurring charge {auth} on my credit card"],
  r=["explain how to stop a recurring charge {auth} on my credit card"],
  clause="before the next billing date",
  slots={"auth": E("negation", ["that I authorized", "that I never authorized"])})

# ---- travel --------------------------------------------------------------
CURRENCIES = [{"s": "US dollar", "p": "US dollars"},
              {"s": "euro", "p": "euros"},
              {"s": "British pound", "p": "British pounds"},
              {"s": "Japanese yen", "p": "Japanese yen"},
              {"s": "Canadian dollar", "p": "Canadian dollars"},
              {"s": "Swiss franc", "p": "Swiss francs"}]
B("travel",
  q=["do I need a visa to visit {country}",
     "is a visa required for a tourist trip to {country}",
     "do I have to get a visa before traveling to {country}"],
  r=["tell me whether I need a visa to visit {country}",
     "find out whether a visa is required for a tourist trip to {country}"],
  clause="as a US citizen",
  slots={"country": E("entity", groups=[
      ["China", "India", "Russia", "Vietnam", "Nigeria"],
      ["Japan", "Mexico", "France", "Thailand", "Italy"]])})
NATIONS = {"us": {"d": "American", "c": "the United States"},
           "mx": {"d": "Mexican", "c": "Mexico"},
           "th": {"d": "Thai", "c": "Thailand"},
           "ph": {"d": "Filipino", "c": "the Philippines"}}
B("travel",
  q=["do {x[d]} citizens need a visa to visit {y[c]} as tourists",
     "is a tourist visa required for {x[d]} citizens visiting {y[c]}",
     "do {x[d]} tourists have to get a visa to visit {y[c]}"],
  r=["tell me whether {x[d]} citizens need a visa to visit {y[c]} as tourists"],
  swaps=[Swap("role_swap", "x", "y", pairs=[
      (NATIONS["us"], NATIONS["mx"]), (NATIONS["us"], NATIONS["th"]),
      (NATIONS["us"], NATIONS["ph"])])])
B("travel",
  q=["what's the exchange rate from {c1[p]} to {c2[p]} today",
     "how many {c2[p]} do I get for one {c1[s]} today",
     "what is one {c1[s]} worth in {c2[p]} today"],
  r=["tell me how many {c2[p]} one {c1[s]} buys today",
     "convert one {c1[s]} to {c2[p]} at today's rate"],
  swaps=[Swap("direction", "c1", "c2", pool=CURRENCIES)])
B("travel",
  q=["will I get a full refund if I cancel a US airline ticket {sc}",
     "is a US airline ticket fully refundable if it gets canceled {sc}",
     "can I get all my money back if I cancel a US airline ticket {sc}"],
  r=["tell me whether I get a full refund if I cancel a US airline ticket {sc}"],
  slots={"sc": E("scope", ["within 24 hours of booking",
                           "more than 24 hours after booking"])})
B("travel",
  q=["what time is it in {c2} when it's {n} pm in {c1}",
     "when it's {n} pm in {c1}, what time is it in {c2}",
     "if it's {n} pm in {c1}, what's the time in {c2}"],
  r=["tell me what time it is in {c2} when it's {n} pm in {c1}",
     "convert {n} pm {c1} time to {c2} time"],
  slots={"n": N([1, 2, 3, 4, 5, 6, 7, 9, 10])},
  swaps=[Swap("direction", "c1", "c2",
              pool=["London", "Tokyo", "New York", "Sydney", "Dubai",
                    "Los Angeles"], alt="entity")])
B("travel",
  q=["what's the carry-on bag allowance on United{spec}",
     "how many carry-on bags can I bring on United{spec}",
     "what carry-on luggage am I allowed on a United flight{spec}"],
  r=["tell me United's carry-on allowance{spec}"],
  slots={"spec": E("specificity", ["", " with a Basic Economy ticket"])})
B("travel",
  q=["can I board a domestic flight in the United States with my driver's license",
     "will TSA accept my driver's license for a domestic flight",
     "is my driver's license enough to fly within the United States"],
  r=["tell me whether I can board a domestic flight in the United States with my driver's license"],
  clause="if the license {ri} REAL ID compliant",
  slots={"ri": E("negation", ["is", "is not"])})
B("travel",
  q=["which floor is {ad} on at Heathrow Terminal 5",
     "what level of Heathrow Terminal 5 is {ad} on",
     "on which floor of Heathrow Terminal 5 is {ad}"],
  r=["tell me which floor {ad} is on at Heathrow Terminal 5"],
  slots={"ad": E("antonym", ["arrivals", "departures"])})
B("travel",
  q=["what's the fastest way to get from {p1} to {p2} by train",
     "what's the quickest train route from {p1} to {p2}",
     "which train gets me from {p1} to {p2} the fastest"],
  r=["tell me the fastest way to get from {p1} to {p2} by train"],
  swaps=[Swap("direction", "p1", "p2", pairs=[
      ("Heathrow Airport", "central London"),
      ("JFK Airport", "Midtown Manhattan"),
      ("Narita Airport", "central Tokyo"),
      ("Charles de Gaulle Airport", "central Paris")])])
B("travel",
  q=["what's the best way to get around {city} without a car",
     "how should I get around {city} if I don't have a car",
     "what's the best way to get around {city} without driving"],
  r=["recommend the best way to get around {city} without a car",
     "tell me the best way to get around {city} without a car"],
  clause="as a first-time traveler",
  slots={"city": E("entity", ["Tokyo", "Paris", "London", "New York City",
                              "Barcelona", "Amsterdam", "Rome"])})
B("travel",
  q=["how much is {amt} in US dollars today",
     "what's {amt} worth in US dollars today",
     "how many US dollars is {amt} today"],
  r=["convert {amt} to US dollars at today's rate",
     "tell me how much {amt} is in US dollars today"],
  slots={"amt": N([50, 100, 200, 250, 500, 1000], fmt=("€{}", "{} euros"))})

# ---- health --------------------------------------------------------------
B("health",
  q=["what is the usual adult dose of {drug}",
     "how much {drug} should an adult take per dose",
     "what's the standard adult dose of {drug}"],
  r=["tell me the usual adult dose of {drug}",
     "give me the standard adult dose of {drug}"],
  slots={"drug": E("entity", ["ibuprofen", "acetaminophen", "naproxen",
                              "aspirin", "cetirizine", "loratadine",
                              "diphenhydramine"])})
B("health",
  q=["can a person with {x} blood donate to someone with {y} blood",
     "can someone who is {x} give blood to a patient who is {y}",
     "is {x} blood safe to give to a {y} recipient"],
  r=["tell me whether a person with {x} blood can donate to someone with {y} blood"],
  clause="for a red blood cell transfusion",
  swaps=[Swap("role_swap", "x", "y", pairs=[
      ("type O negative", "type A positive"),
      ("type O negative", "type B negative"),
      ("type A negative", "type AB positive"),
      ("type O positive", "type A positive"),
      ("type B negative", "type AB negative"),
      ("type A positive", "type AB positive")])])
B("health",
  q=["should I see a doctor",
     "do I need to see a doctor",
     "should I get checked out by a doctor"],
  r=["tell me whether I should see a doctor"],
  clause="if my fever {fv} after {n}",
  slots={"fv": E("negation", ["goes away", "hasn't gone away"]),
         "n": N([3], kind=None, fmt=("{} days", "{} days"))})
B("health",
  q=["what is my BMI if I weigh {w} and I'm {h} tall",
     "what's the BMI of someone who weighs {w} and is {h} tall",
     "if I weigh {w} and I'm {h} tall, what's my BMI"],
  r=["calculate my BMI if I weigh {w} and I'm {h} tall",
     "work out the BMI of someone who weighs {w} and is {h} tall"],
  slots={"w": N([55, 60, 65, 70, 75, 90, 95, 100], fmt=("{} kg", "{} kilograms")),
         "h": N([155, 160, 165, 170, 175, 180, 185, 190],
                fmt=("{} cm", "{} centimeters"))})
B("health",
  q=["should I take omeprazole {ba} a meal",
     "is omeprazole meant to be taken {ba} a meal",
     "am I supposed to take my omeprazole {ba} a meal"],
  r=["tell me whether I should take omeprazole {ba} a meal"],
  slots={"ba": E("scope", ["before", "after"])})
B("health",
  q=["what fasting blood sugar level should I aim for{spec}",
     "what's a healthy target for fasting blood sugar{spec}",
     "what fasting glucose level is a good target{spec}"],
  r=["tell me what fasting blood sugar level I should aim for{spec}"],
  slots={"spec": E("specificity", ["", " if I have type 2 diabetes"])})
B("health",
  q=["what are the common symptoms of {bp} blood pressure",
     "what symptoms does {bp} blood pressure usually cause",
     "what are the typical signs of {bp} blood pressure"],
  r=["list the common symptoms of {bp} blood pressure",
     "describe the typical symptoms of {bp} blood pressure"],
  clause="in adults",
  slots={"bp": E("antonym", ["high", "low"])})
B("health",
  q=["how many times should my baby see a pediatrician in the {yr} year",
     "how many pediatrician visits does a baby need in the {yr} year",
     "how many checkups with a pediatrician should my baby have in the {yr} year"],
  r=["tell me how many pediatrician visits a baby needs in the {yr} year"],
  slots={"yr": N([1, 2], ordinal=True)})
B("health",
  q=["how is {dis} usually treated",
     "what's the usual treatment for {dis}",
     "how do doctors typically treat {dis}"],
  r=["explain how {dis} is usually treated",
     "describe the usual treatment for {dis}"],
  clause="in adults",
  slots={"dis": E("entity", ["strep throat", "shingles", "Lyme disease",
                             "appendicitis", "iron-deficiency anemia",
                             "gout"])})
B("health",
  q=["can I drink alcohol while taking {ab}",
     "is it safe to have alcohol while I'm on {ab}",
     "is it okay to drink alcohol during a course of {ab}"],
  r=["tell me whether I can drink alcohol while taking {ab}"],
  slots={"ab": E("entity", groups=[["metronidazole", "tinidazole"],
                                   ["amoxicillin", "azithromycin",
                                    "cephalexin"]])})
B("health",
  q=["how do I convert a blood sugar reading from {u1} to {u2}",
     "what's the formula to change a blood sugar reading from {u1} into {u2}",
     "how can I turn a blood sugar reading in {u1} into {u2}"],
  r=["explain how to convert a blood sugar reading from {u1} to {u2}"],
  swaps=[Swap("direction", "u1", "u2", pairs=[("mg/dL", "mmol/L")])])
B("health",
  q=["how many 200 mg ibuprofen tablets make a~ {dose} dose",
     "how many 200 mg tablets of ibuprofen do I need for a~ {dose} dose",
     "how many 200 mg ibuprofen pills add up to a~ {dose} dose"],
  r=["tell me how many 200 mg ibuprofen tablets make a~ {dose} dose"],
  slots={"dose": N([400, 600, 800], fmt=("{} mg", "{} milligram"))})

# ---- cooking -------------------------------------------------------------
B("cooking",
  q=["how many tablespoons are in {n}",
     "how many tablespoons make up {n}",
     "how many tablespoons equal {n}"],
  r=["convert {n} to tablespoons",
     "tell me how many tablespoons are in {n}"],
  slots={"n": N([2, 3, 4, 5, 6], fmt=("{} cups", "{} cups"))})
B("cooking",
  q=["how do I make {spec}pancakes from scratch",
     "what's a good recipe for homemade {spec}pancakes",
     "how can I make {spec}pancakes at home from scratch"],
  r=["give me a recipe for {spec}pancakes from scratch",
     "explain how to make {spec}pancakes from scratch"],
  slots={"spec": E("specificity", ["", "vegan ", "gluten-free "])})
B("cooking",
  q=["how long do I cook {spec}rice on the stove",
     "how long does {spec}rice take to cook on the stovetop",
     "what's the cooking time for {spec}rice on the stove"],
  r=["tell me how long to cook {spec}rice on the stove"],
  slots={"spec": E("specificity", ["", "brown ", "wild "])})
B("cooking",
  q=["how can I make my homemade yogurt {tt}",
     "what's the trick to getting homemade yogurt {tt}",
     "how do I get my homemade yogurt to turn out {tt}"],
  r=["tell me how to make homemade yogurt {tt}"],
  slots={"tt": E("antonym", ["thicker", "thinner"])})
B("cooking",
  q=["why did my cake {sr} in the center",
     "what made my cake {sr} in the center",
     "what caused my cake to {sr} in the center"],
  r=["explain why my cake would {sr} in the center"],
  slots={"sr": E("antonym", ["sink", "dome up"])})
B("cooking",
  q=["can I use {x} instead of {y} in a recipe, and how much",
     "can I substitute {x} for {y} in a recipe, and in what amount",
     "if a recipe calls for {y}, can I use {x} instead, and how much"],
  r=["tell me how to use {x} instead of {y} in a recipe, and how much"],
  swaps=[Swap("role_swap", "x", "y", pairs=[
      ("baking soda", "baking powder"), ("oil", "butter"),
      ("honey", "sugar"), ("dried herbs", "fresh herbs")])])
B("cooking",
  q=["how long should I let a steak rest {ba} cooking it",
     "how many minutes should a steak sit {ba} I cook it",
     "what's the right resting time for a steak {ba} cooking it"],
  r=["tell me how long to let a steak rest {ba} cooking it"],
  slots={"ba": E("scope", ["before", "after"])})
B("cooking",
  q=["what internal temperature should {meat} be cooked to",
     "what's the safe internal temperature for {meat}",
     "how hot does the inside of {meat} need to get to be safe to eat"],
  r=["tell me the safe internal temperature for {meat}"],
  slots={"meat": E("entity", groups=[["chicken breast", "turkey"],
                                     ["ground beef", "ground pork"],
                                     ["pork chops", "salmon fillets"]])})
B("cooking",
  q=["how can I thicken a gravy",
     "what's the best way to thicken a gravy",
     "how do I make a gravy thicker"],
  r=["tell me how to thicken a gravy",
     "explain the best way to thicken a gravy"],
  clause="if I {hv} cornstarch on hand",
  slots={"hv": E("negation", ["have", "don't have"])})
B("cooking",
  q=["how do I convert an oven temperature from {u1} to {u2}",
     "what's the formula to change an oven temperature from {u1} into {u2}",
     "how do I turn a {u1} oven setting into {u2}"],
  r=["explain how to convert an oven temperature from {u1} to {u2}",
     "show me the formula for converting oven temperatures from {u1} to {u2}"],
  swaps=[Swap("direction", "u1", "u2", pairs=[("Celsius", "Fahrenheit")])])
B("cooking",
  q=["how long should I roast a {n}-pound turkey",
     "how long does a {n}-pound turkey take to roast",
     "what's the roasting time for a {n}-pound turkey"],
  r=["tell me how long to roast a {n}-pound turkey"],
  clause="at 325°F",
  slots={"n": N([10, 12, 14, 16, 20, 22])})
B("cooking",
  q=["how do I make my soup more flavorful without adding salt",
     "how can I give my soup more flavor without adding salt",
     "what can I do to make my soup more flavorful without using more salt"],
  r=["suggest ways to make my soup more flavorful without adding salt"])

# ---- software ------------------------------------------------------------
B("software",
  q=["how do I take a screenshot{spec} on {os}",
     "how can I capture a screenshot{spec} on {os}",
     "what's the way to take a screenshot{spec} on {os}"],
  r=["explain how to take a screenshot{spec} on {os}",
     "show me how to capture a screenshot{spec} on {os}"],
  slots={"spec": E("specificity", ["", " of just one window"]),
         "os": E("entity", ["Windows 11", "a Mac", "a Chromebook", "Ubuntu"])})
B("software",
  q=["how do I {zu} files on Windows 11",
     "how can I {zu} files in Windows 11",
     "what are the steps to {zu} files on a Windows 11 PC"],
  r=["explain how to {zu} files on Windows 11",
     "walk me through how to {zu} files on Windows 11"],
  slots={"zu": E("antonym", ["zip", "unzip"])})
B("software",
  q=["how do I {pw} a PDF in Adobe Acrobat",
     "how can I {pw} a PDF using Adobe Acrobat",
     "what are the steps to {pw} a PDF file in Adobe Acrobat"],
  r=["explain how to {pw} a PDF in Adobe Acrobat"],
  slots={"pw": E("antonym", ["add a password to", "remove the password from"])})
B("software",
  q=["which Office apps can I use on my PC",
     "what Office apps do I get on my PC",
     "which Microsoft Office programs can I use on my computer"],
  r=["list the Office apps I can use on my PC"],
  clause="if I {hv} a Microsoft 365 subscription",
  slots={"hv": E("negation", ["have", "don't have"])})
B("software",
  q=["what are the main new features in {ver}",
     "what's new in {ver}",
     "what new features were added in {ver}"],
  r=["list the main new features in {ver}",
     "summarize what's new in {ver}"],
  slots={"ver": E("number", ["iOS 15", "iOS 16", "iOS 17", "iOS 18"])})
B("software",
  q=["can I recover a file I deleted from OneDrive {sc}",
     "is it possible to restore a OneDrive file I deleted {sc}",
     "can a file I deleted from OneDrive {sc} still be recovered"],
  r=["tell me whether I can recover a file I deleted from OneDrive {sc}"],
  clause="on a personal account",
  slots={"sc": E("scope", ["less than 30 days ago", "more than 30 days ago"])})
B("software",
  q=["how can {x} get edit access to {y} Outlook calendar",
     "how do I set things up so {x} can edit {y} Outlook calendar",
     "what steps let {xo} edit {y} calendar in Outlook"],
  r=["explain how {x} can get edit access to {y} Outlook calendar"],
  slots={"who": E("role_swap", [
      {"x": "my assistant", "xo": "my assistant", "y": "my"},
      {"x": "I", "xo": "me", "y": "my assistant's"}])})
B("software",
  q=["how do I transfer photos from my {x} to my {y}",
     "how can I move photos from my {x} to my {y}",
     "what's the way to copy my photos from my {x} over to my {y}"],
  r=["explain how to transfer photos from my {x} to my {y}"],
  swaps=[Swap("direction", "x", "y", pairs=[("iPhone", "Windows PC"),
                                            ("Android phone", "Mac")])])
B("software",
  q=["how do I change the default font color in {app}",
     "how can I set a different default font color in {app}",
     "where do I change the default font color in {app}"],
  r=["show me how to change the default font color in {app}"],
  slots={"app": E("entity", ["Microsoft Word", "Google Docs", "Outlook",
                             "LibreOffice Writer"])})
B("software",
  q=["how do I organize my bookmarks into folders in {br}",
     "how can I organize my bookmarks into folders in {br}",
     "what's the way to sort my bookmarks into folders in {br}"],
  r=["explain how to organize my bookmarks into folders in {br}"],
  slots={"br": E("entity", ["Chrome", "Firefox", "Safari", "Microsoft Edge"])})
B("software",
  q=["how do I make my Windows 11 screen lock automatically after {n} of inactivity",
     "how can I set Windows 11 to lock the screen after {n} of inactivity",
     "what's the way to get Windows 11 to lock my screen after {n} of inactivity"],
  r=["show me how to make my Windows 11 screen lock automatically after {n} of inactivity"],
  slots={"n": N([5, 10, 15, 20, 30], kind=None, fmt=("{} minutes", "{} minutes"))})
B("software",
  q=["how do I reset my Google account password{spec}",
     "what's the process for resetting my Google account password{spec}",
     "how can I reset the password of my Google account{spec}"],
  r=["walk me through resetting my Google account password{spec}"],
  slots={"spec": E("specificity", ["", " if I no longer have access to my recovery phone or email"])})

# ---- retail --------------------------------------------------------------
B("retail",
  q=["if an item costs {p} and it's {d} off, what's the final price",
     "what's the sale price of an item priced at {p} at {d} off",
     "how much do I pay for an item that normally costs {p} if it's {d} off"],
  r=["calculate the final price of an item that costs {p} with {d} off",
     "work out the sale price of an item priced at {p} at {d} off"],
  slots={"p": N([40, 45, 60, 120, 250, 300], fmt=MONEY),
         "d": N([10, 15, 20, 25, 30, 40], fmt=PCT)})
B("retail",
  q=["can I still return something I bought on Amazon {sc}",
     "will Amazon accept a return {sc}",
     "is it possible to return an Amazon order {sc}"],
  r=["tell me whether I can return something I bought on Amazon {sc}"],
  slots={"sc": E("scope", ["within 30 days of delivery",
                           "more than 30 days after delivery"])})
B("retail",
  q=["what is {store}'s return policy for opened electronics",
     "how does {store} handle returns of opened electronics",
     "what's {store}'s policy on returning electronics that have been opened"],
  r=["explain {store}'s return policy for opened electronics"],
  slots={"store": E("entity", ["Best Buy", "Walmart", "Target", "Costco",
                               "Amazon"])})
B("retail",
  q=["how do I {v} a gift card {p} my Amazon account",
     "how can I {v} a gift card {p} my Amazon account",
     "what are the steps to {v} a gift card {p} my Amazon account"],
  r=["explain how to {v} a gift card {p} my Amazon account"],
  clause="using the Amazon mobile app",
  slots={"gc": E("antonym", [{"v": "add", "p": "to"},
                              {"v": "remove", "p": "from"}])})
B("retail",
  q=["can I return an item {wr} a receipt at {store}",
     "does {store} accept returns {wr} a receipt",
     "will {store} take back an item {wr} a receipt"],
  r=["tell me whether I can return an item {wr} a receipt at {store}"],
  slots={"wr": E("negation", ["with", "without"]),
         "store": E(None, ["Walmart", "Target", "Home Depot", "Best Buy"])})
B("retail",
  q=["can a {x} leave negative feedback for a {y} on eBay",
     "is it possible for an eBay {x} to give a {y} negative feedback",
     "on eBay, can the {x} leave negative feedback about the {y}"],
  r=["tell me whether a {x} can leave negative feedback for a {y} on eBay"],
  swaps=[Swap("role_swap", "x", "y", pairs=[("buyer", "seller")])])
B("retail",
  q=["how long is the warranty on a new iPhone{spec}",
     "what's the warranty period for a new iPhone{spec}",
     "how long does the warranty last on a new iPhone{spec}"],
  r=["tell me the warranty period for a new iPhone{spec}"],
  slots={"spec": E("specificity", ["", " bought in the EU"])})
B("retail",
  q=["how much does it cost to ship a {w} parcel from {x} to {y} with DHL",
     "what's the DHL price to send a {w} parcel from {x} to {y}",
     "how much will DHL charge to ship a {w} parcel from {x} to {y}"],
  r=["tell me how much it costs to ship a {w} parcel from {x} to {y} with DHL"],
  slots={"w": N([2, 3, 5, 10, 20], fmt=("{} kg", "{} kilogram"))},
  swaps=[Swap("direction", "x", "y",
              pool=["the United States", "Canada", "the United Kingdom",
                    "Germany", "Australia"], alt="entity")])
B("retail",
  q=["can I return earrings bought at a jewelry store if they {wn} been worn",
     "will a jewelry store take back earrings if they {wn} been worn",
     "is it possible to return earrings to a jewelry store if they {wn} been worn"],
  r=["tell me whether I can return earrings bought at a jewelry store if they {wn} been worn"],
  slots={"wn": E("negation", ["have", "haven't"])})
B("retail",
  q=["how do I stop receiving the {store} catalog in the mail",
     "how can I stop getting the {store} catalog in the mail",
     "what's the way to stop {store} from mailing me its catalog"],
  r=["tell me how to stop receiving the {store} catalog in the mail"],
  slots={"store": E("entity", ["IKEA", "Pottery Barn", "L.L.Bean",
                               "Williams Sonoma"])})
B("retail",
  q=["can I cancel an Amazon order that {sh} shipped",
     "is it possible to cancel an Amazon order that {sh} shipped",
     "am I able to cancel an Amazon order that {sh} shipped"],
  r=["tell me whether I can cancel an Amazon order that {sh} shipped"],
  slots={"sh": E("negation", ["has already", "hasn't"])})

# ---- telecom -------------------------------------------------------------
CARRIERS = ["T-Mobile", "AT&T", "Verizon"]
B("telecom",
  q=["how long does it take to download a {n} file on a {s} connection",
     "how long will a {n} file take to download on a {s} connection",
     "how much time does downloading a {n} file take on a {s} connection"],
  r=["calculate how long it takes to download a {n} file on a {s} connection"],
  slots={"n": N([2, 4, 5, 10, 20, 50], fmt=("{} GB", "{} gigabyte")),
         "s": N([50, 100, 200, 500], fmt=("{} Mbps", "{} megabit"))})
B("telecom",
  q=["what are the APN settings for {carrier}",
     "which APN settings should I use for {carrier}",
     "what APN settings do I need to enter for {carrier}"],
  r=["give me the APN settings for {carrier}",
     "tell me which APN settings to use for {carrier}"],
  clause="on an Android phone",
  slots={"carrier": E("entity", CARRIERS + ["Vodafone UK", "EE"])})
B("telecom",
  q=["how do I port my phone number from {x} to {y}",
     "what are the steps to transfer my phone number from {x} to {y}",
     "how can I move my phone number from {x} over to {y}"],
  r=["walk me through porting my phone number from {x} to {y}"],
  swaps=[Swap("direction", "x", "y", pool=CARRIERS)])
B("telecom",
  q=["will I be charged an early termination fee if I cancel {sc} my contract ends",
     "do I have to pay an early termination fee if I leave {sc} my contract ends",
     "is there an early termination fee for canceling service {sc} my contract ends"],
  r=["tell me whether I'll owe an early termination fee if I cancel {sc} my contract ends"],
  slots={"sc": E("scope", ["before", "after"])})
B("telecom",
  q=["can I use a local SIM card abroad",
     "will a local SIM card work in my phone when I'm abroad",
     "can I put a local SIM card in my phone while traveling abroad"],
  r=["tell me whether I can use a local SIM card abroad"],
  clause="if my phone {ul} carrier-unlocked",
  slots={"ul": E("negation", ["is", "is not"])})
B("telecom",
  q=["why is my phone bill {hl} than usual this month",
     "what could make my phone bill {hl} than usual this month",
     "why did my phone bill come out {hl} than usual this month"],
  r=["explain why my phone bill might be {hl} than usual this month"],
  slots={"hl": E("antonym", ["higher", "lower"])})
B("telecom",
  q=["can I use a {x} SIM card in a phone that takes a {y} SIM",
     "will a {x} SIM work in a phone built for {y} SIM cards",
     "does a {x} SIM work in a phone with a {y} SIM slot"],
  r=["tell me whether a {x} SIM card works in a phone that takes a {y} SIM"],
  swaps=[Swap("role_swap", "x", "y", pairs=[("nano", "micro"),
                                            ("micro", "standard"),
                                            ("nano", "standard")])])
B("telecom",
  q=["how do I check my voicemail{spec}",
     "how can I listen to my voicemail{spec}",
     "what's the way to check my voicemail messages{spec}"],
  r=["explain how to check my voicemail{spec}"],
  clause="on my {carrier} line",
  slots={"spec": E("specificity", ["", " from another phone"]),
         "carrier": E(None, CARRIERS)})
B("telecom",
  q=["how do I check if fiber broadband is available at my address in {country}",
     "how can I find out whether fiber broadband is available at my address in {country}",
     "what's the way to see if I can get fiber broadband at my address in {country}"],
  r=["tell me how to check if fiber broadband is available at my address in {country}"],
  slots={"country": E("entity", ["the UK", "the United States", "Canada",
                                 "Australia", "Germany"])})
B("telecom",
  q=["how much data does streaming HD video for {n} use",
     "how much mobile data will {n} of HD video streaming use",
     "how many gigabytes does {n} of HD video streaming use"],
  r=["estimate how much data {n} of HD video streaming uses"],
  slots={"n": N([2, 3, 4, 5, 6, 10], fmt=("{} hours", "{} hours"))})
B("telecom",
  q=["why is my internet {ud} speed so slow",
     "what makes my internet {ud} speed so slow",
     "why is my {ud} speed so slow on my home internet"],
  r=["explain why my internet {ud} speed is so slow"],
  clause="on a cable connection",
  slots={"ud": E("direction", ["upload", "download"])})

# ---- education -----------------------------------------------------------
B("education",
  q=["what percentage is a score of {s} out of {t}",
     "if I scored {s} out of {t} on a test, what's my percentage",
     "what's {s} out of {t} as a percentage"],
  r=["convert a score of {s} out of {t} to a percentage",
     "work out my percentage if I scored {s} out of {t}"],
  slots={"s": N([30, 35, 38, 42, 45, 47]),
         "t": N([50], kind=None)})
B("education",
  q=["where is the main campus of {uni} located",
     "in what city is {uni}'s main campus",
     "where is {uni}'s main campus"],
  r=["tell me where {uni}'s main campus is located"],
  slots={"uni": E("entity", ["Stanford University", "Harvard University",
                             "Yale University", "Princeton University",
                             "the University of Michigan", "Duke University",
                             "Rice University"])})
B("education",
  q=["what's the {mm} number of credits a full-time undergraduate can take per semester",
     "what is the {mm} course load in credits for a full-time undergraduate each semester",
     "how many credits per semester is the {mm} for a full-time undergraduate"],
  r=["tell me the {mm} number of credits a full-time undergraduate can take per semester"],
  slots={"mm": E("scope", ["minimum", "maximum"])})
B("education",
  q=["how do I {ad} a class after the semester has started",
     "what's the process to {ad} a class once the semester has begun",
     "how can I {ad} a class after the semester has already started"],
  r=["explain how to {ad} a class after the semester has started"],
  slots={"ad": E("antonym", ["add", "drop"])})
B("education",
  q=["will I lose my scholarship",
     "will my scholarship be taken away",
     "is my scholarship going to be taken away"],
  r=["tell me whether I'll lose my scholarship"],
  clause="if I {mt} the required minimum GPA",
  slots={"mt": E("negation", ["maintain", "don't maintain"])})
B("education",
  q=["how do I transfer my credits from {x} to {y}",
     "what's the process for transferring credits from {x} to {y}",
     "how can I get my credits transferred from {x} to {y}"],
  r=["explain how to transfer my credits from {x} to {y}"],
  swaps=[Swap("direction", "x", "y", pairs=[
      ("a community college", "a four-year university")])])
B("education",
  q=["do I need a {x} to apply for a {y} program",
     "is a {x} required to enroll in a {y} program",
     "must I have a {x} before I can apply to a {y} program"],
  r=["tell me whether I need a {x} to apply for a {y} program"],
  swaps=[Swap("role_swap", "x", "y", pairs=[
      ("bachelor's degree", "master's degree")])])
B("education",
  q=["how do I calculate my {spec}GPA",
     "how is my {spec}GPA calculated",
     "what's the formula for working out my {spec}GPA"],
  r=["explain how to calculate my {spec}GPA",
     "show me how to work out my {spec}GPA"],
  clause="in high school",
  slots={"spec": E("specificity", ["", "weighted "])})
B("education",
  q=["how do I book an appointment with my school counselor",
     "how can I schedule an appointment with my school counselor",
     "what's the way to set up an appointment with my school counselor"],
  r=["explain how to book an appointment with my school counselor"],
  clause="to talk about college applications")
B("education",
  q=["how long is the {exam}",
     "how much time does the {exam} take",
     "what's the total testing time for the {exam}"],
  r=["tell me how long the {exam} takes"],
  slots={"exam": E("entity", ["SAT", "ACT", "GRE", "GMAT", "LSAT"])})
B("education",
  q=["how much is tuition for the full-time MBA program at {bs}",
     "what does the full-time MBA program at {bs} cost in tuition",
     "what's the tuition for the full-time MBA program at {bs}"],
  r=["tell me the tuition for the full-time MBA program at {bs}"],
  slots={"bs": E("entity", ["Wharton", "Harvard Business School", "INSEAD",
                            "London Business School"])})

# ---- government ----------------------------------------------------------
B("government",
  q=["how do I renew my driver's license in {state}",
     "what's the process for renewing my driver's license in {state}",
     "how can I get my driver's license renewed in {state}"],
  r=["explain how to renew my driver's license in {state}"],
  slots={"state": E("entity", ["California", "Texas", "New York", "Florida",
                               "Illinois"])})
B("government",
  q=["if my adult US passport was issued in {yr}, when does it expire",
     "when does an adult US passport issued in {yr} expire",
     "what year will my adult US passport from {yr} expire"],
  r=["tell me when an adult US passport issued in {yr} expires"],
  slots={"yr": N(list(range(2016, 2025)), words=False, group=False)})
B("government",
  q=["can I vote in the US presidential election if I turn {n} {sc} election day",
     "am I allowed to vote in the US presidential election if my {nth} birthday is {sc} election day",
     "if I turn {n} {sc} election day, can I vote in the US presidential election"],
  r=["tell me whether I can vote in the US presidential election if I turn {n} {sc} election day"],
  slots={"n": N([18], kind=None), "nth": N([18], kind=None, ordinal=True),
         "sc": E("scope", ["the week before", "the week after"])})
B("government",
  q=["how do I apply for my first US passport",
     "what's the process to apply for my first US passport",
     "how can I get my first US passport"],
  r=["explain how to apply for my first US passport"],
  clause="if I {hv} a copy of my birth certificate",
  slots={"hv": E("negation", ["have", "don't have"])})
B("government",
  q=["how do I {v} the federal income tax withheld from my paycheck",
     "what's the way to {v} my federal income tax withholding",
     "how can I get my employer to withhold {ml} federal income tax from my paycheck"],
  r=["explain how to {v} the federal income tax withheld from my paycheck"],
  slots={"id": E("antonym", [{"v": "increase", "ml": "more"},
                              {"v": "decrease", "ml": "less"}])})
B("government",
  q=["how do I transfer my car registration from {x} to {y}",
     "what do I need to do to move my car registration from {x} to {y}",
     "how can I switch my car registration from {x} to {y}"],
  r=["explain how to transfer my car registration from {x} to {y}"],
  swaps=[Swap("direction", "x", "y",
              pool=["California", "Texas", "New York", "Florida"],
              alt="entity")])
B("government",
  q=["how much notice does a {x} have to give a {y} to end a month-to-month lease",
     "how many days' notice must a {x} give a {y} to end a month-to-month lease",
     "what's the required notice period for a {x} ending a month-to-month lease with a {y}"],
  r=["tell me how much notice a {x} has to give a {y} to end a month-to-month lease"],
  clause="in California",
  swaps=[Swap("role_swap", "x", "y", pairs=[("landlord", "tenant")])])
B("government",
  q=["how do I apply for a US passport{spec}",
     "what's the process for getting a US passport{spec}",
     "how can I get a US passport{spec}"],
  r=["walk me through applying for a US passport{spec}"],
  slots={"spec": E("specificity", ["", " for my child under 16"])})
B("government",
  q=["what is the minimum wage in {state}",
     "what's the current minimum wage in {state}",
     "how much is the state minimum wage in {state}"],
  r=["tell me the minimum wage in {state}"],
  slots={"state": E("entity", ["California", "Washington", "New York",
                               "Florida", "Texas", "Colorado"])})
B("government",
  q=["how do I file a wage complaint with the {state} labor department",
     "what's the process to file a wage complaint with the {state} labor department",
     "how can I file a complaint about unpaid wages with the {state} labor department"],
  r=["explain how to file a wage complaint with the {state} labor department"],
  slots={"state": E("entity", ["California", "New York", "Texas",
                               "Washington", "Illinois"])})

# ---- fitness -------------------------------------------------------------
B("fitness",
  q=["what's my estimated maximum heart rate if I'm {age} years old",
     "what is the estimated maximum heart rate for a~ {age}-year-old",
     "if I'm {age} years old, what's my estimated maximum heart rate"],
  r=["calculate my estimated maximum heart rate at {age} years old"],
  slots={"age": N([25, 30, 35, 40, 45, 50, 55, 60])})
B("fitness",
  q=["roughly how many calories do I burn running {n}",
     "about how many calories does running {n} burn",
     "approximately how many calories will I burn if I run {n}"],
  r=["estimate how many calories I burn running {n}"],
  clause="at a moderate pace",
  slots={"n": N([3, 5, 6, 10, 15, 21], fmt=("{} kilometers", "{} kilometers"))})
B("fitness",
  q=["should I {io} as I push the bar up on a bench press",
     "is it right to {io} while pressing the bar up during a bench press",
     "do I {io} when I push the bar up on the bench press"],
  r=["tell me whether I should {io} as I push the bar up on a bench press"],
  slots={"io": E("antonym", ["exhale", "inhale"])})
B("fitness",
  q=["should I do static stretching {ba} a run",
     "is static stretching a good idea {ba} a run",
     "is it a good idea to do static stretches {ba} a run"],
  r=["tell me whether I should do static stretching {ba} a run"],
  slots={"ba": E("scope", ["before", "after"])})
B("fitness",
  q=["what's the {mm} number of days per week I should lift weights",
     "what is the {mm} number of weight training sessions I should do each week",
     "what's the {mm} number of strength workouts I should do per week"],
  r=["tell me the {mm} number of days per week I should lift weights"],
  clause="as a beginner",
  slots={"mm": E("scope", ["minimum", "maximum"])})
B("fitness",
  q=["what muscles do {ex} work",
     "which muscles are worked by {ex}",
     "what muscle groups do {ex} target"],
  r=["list the muscles that {ex} work",
     "tell me which muscles {ex} work"],
  slots={"ex": E("entity", ["squats", "deadlifts", "pull-ups", "push-ups",
                            "lunges", "planks"])})
B("fitness",
  q=["should I work out the same muscles again today",
     "is it okay to train the same muscle group again today",
     "can I work the same muscles again today"],
  r=["tell me whether I should work out the same muscles again today"],
  clause="if I'm {sr} sore from yesterday's workout",
  slots={"sr": E("negation", ["still", "no longer"])})
B("fitness",
  q=["should I do {x} before {y}",
     "is it a good idea to do {x} before {y}",
     "should {x} come before {y} in my workout"],
  r=["tell me whether I should do {x} before {y}"],
  clause="if my main goal is to build strength",
  swaps=[Swap("role_swap", "x", "y", pairs=[("cardio", "weight training")])])
B("fitness",
  q=["how much protein should I eat per day{spec}",
     "how many grams of protein do I need each day{spec}",
     "what's the recommended daily protein intake{spec}"],
  r=["tell me how much protein I should eat per day{spec}"],
  slots={"spec": E("specificity", ["", " to build muscle"])})
B("fitness",
  q=["how do I convert my running pace from {u1} to {u2}",
     "what's the formula to change a running pace in {u1} into {u2}",
     "how can I turn a running pace in {u1} into {u2}"],
  r=["explain how to convert my running pace from {u1} to {u2}"],
  swaps=[Swap("direction", "u1", "u2", pairs=[
      ("minutes per mile", "minutes per kilometer")])])
B("fitness",
  q=["how long will it take to walk {n} at 3 miles per hour",
     "how much time does walking {n} at 3 miles per hour take",
     "at 3 miles per hour, how long does it take to walk {n}"],
  r=["work out how long it takes to walk {n} at 3 miles per hour"],
  slots={"n": N([2, 4, 5, 6, 9, 12], fmt=("{} miles", "{} miles"))})
B("fitness",
  q=["what should I eat to {gl} weight as a runner",
     "how should I change my diet to {gl} weight as a runner",
     "what kind of diet helps a runner {gl} weight"],
  r=["tell me what to eat to {gl} weight as a runner"],
  slots={"gl": E("antonym", ["gain", "lose"])})

# ---- science -------------------------------------------------------------
B("science",
  q=["what is {n} {u1} in {u2}",
     "how much is {n} {u1} in {u2}",
     "what's {n} {u1} converted to {u2}"],
  r=["convert {n} {u1} to {u2}",
     "tell me what {n} {u1} is in {u2}"],
  slots={"n": N([10, 20, 25, 30, 35, 50, 60, 100],
                fmt=("{} degrees", "{} degrees"))},
  swaps=[Swap("direction", "u1", "u2", pairs=[("Celsius", "Fahrenheit")])])
B("science",
  q=["what is the boiling point of {sub}",
     "at what temperature does {sub} boil",
     "what's the boiling temperature of {sub}"],
  r=["tell me the boiling point of {sub}"],
  clause="at sea level",
  slots={"sub": E("entity", ["water", "ethanol", "acetone", "nitrogen",
                             "mercury", "methanol"])})
B("science",
  q=["does {x} orbit {y}",
     "does {x} revolve around {y}",
     "is {x} in orbit around {y}"],
  r=["tell me whether {x} orbits {y}"],
  swaps=[Swap("role_swap", "x", "y", pairs=[
      ("the Moon", "Earth"), ("Earth", "the Sun"), ("Phobos", "Mars"),
      ("Titan", "Saturn")])])
B("science",
  q=["is it safe to pour {x} into {y}",
     "should I add {x} to {y} when diluting",
     "is adding {x} to {y} the safe way to dilute"],
  r=["tell me whether it's safe to pour {x} into {y}"],
  swaps=[Swap("role_swap", "x", "y", pairs=[
      ("concentrated sulfuric acid", "water")])])
B("science",
  q=["do metals {ec} when they are heated",
     "does heating a metal make it {ec}",
     "do metals {ec} as their temperature rises"],
  r=["tell me whether metals {ec} when they are heated"],
  slots={"ec": E("antonym", ["expand", "contract"])})
B("science",
  q=["what is the {hl} temperature ever recorded on Earth",
     "what's the {hl} air temperature ever measured on Earth",
     "what was the {hl} temperature ever recorded on our planet"],
  r=["tell me the {hl} temperature ever recorded on Earth"],
  slots={"hl": E("antonym", ["highest", "lowest"])})
B("science",
  q=["which is the {sl} planet in our solar system",
     "what's the {sl} planet in the solar system",
     "which planet in our solar system is the {sl}"],
  r=["tell me the {sl} planet in our solar system",
     "name the {sl} planet in our solar system"],
  slots={"sl": E("scope", ["smallest", "largest"])})
B("science",
  q=["which planets in our solar system {hr} rings",
     "what planets in the solar system {hr} rings",
     "which of the planets in our solar system {hr} rings"],
  r=["list the planets in our solar system that {hr} rings"],
  slots={"hr": E("negation", ["have", "don't have"])})
B("science",
  q=["what is the speed of light{spec}",
     "how fast does light travel{spec}",
     "what's the speed at which light travels{spec}"],
  r=["tell me the speed of light{spec}"],
  slots={"spec": E("specificity", ["", " in water", " in glass"])})
B("science",
  q=["how much of {m} of carbon-14 is left after {n}",
     "what mass remains from {m} of carbon-14 after {n}",
     "if I start with {m} of carbon-14, how much is left after {n}"],
  r=["calculate how much of {m} of carbon-14 is left after {n}"],
  slots={"m": N([80, 100, 160, 200, 400], fmt=("{} g", "{} grams")),
         "n": N([2, 3, 4, 5], fmt=("{} half-lives", "{} half-lives"))})
B("science",
  q=["what color does {el} turn a flame",
     "what flame color does {el} produce in a flame test",
     "what color flame does {el} give in a flame test"],
  r=["tell me what flame color {el} produces in a flame test"],
  slots={"el": E("entity", ["lithium", "sodium", "potassium", "copper",
                            "barium"])})
B("science",
  q=["what is the density of {met}",
     "what density does {met} have",
     "how dense is {met}"],
  r=["tell me the density of {met}"],
  slots={"met": E("entity", ["aluminum", "copper", "iron", "gold", "lead"])})

# ---- programming ---------------------------------------------------------
LANGS = ["Python", "JavaScript", "Java", "C#", "Ruby", "Go"]
B("programming",
  q=["how do I reverse a string in {lang}",
     "how can I reverse a string in {lang}",
     "what's the way to reverse a string in {lang}"],
  r=["show me how to reverse a string in {lang}",
     "write code to reverse a string in {lang}"],
  slots={"lang": E("entity", LANGS)})
B("programming",
  q=["how do I sort {what} in Python",
     "how can I sort {what} in Python",
     "what's the way to sort {what} in Python"],
  r=["show me how to sort {what} in Python"],
  slots={"what": E("specificity", ["a list",
                                   "a list of dictionaries by one of their keys"])})
B("programming",
  q=["how do I convert a~ {x} to a~ {y} in Python",
     "how can I turn a~ {x} into a~ {y} in Python",
     "what's the way to change a~ {x} into a~ {y} in Python"],
  r=["show me how to convert a~ {x} to a~ {y} in Python"],
  swaps=[Swap("direction", "x", "y", pairs=[
      ("string", "integer"), ("list", "tuple"),
      ("dictionary", "JSON string"), ("string", "list of characters")])])
B("programming",
  q=["what's the maximum value of a~ {n} unsigned integer",
     "what is the largest number a~ {n} unsigned integer can hold",
     "what's the biggest value that fits in a~ {n} unsigned integer"],
  r=["tell me the maximum value of a~ {n} unsigned integer"],
  slots={"n": N([8, 16, 32, 64], fmt=("{}-bit", "{}-bit"))})
B("programming",
  q=["what's new in Python {ver}",
     "what are the main new features in Python {ver}",
     "what new features were added in Python {ver}"],
  r=["summarize what's new in Python {ver}",
     "list the main new features in Python {ver}"],
  slots={"ver": E("number", ["3.10", "3.11", "3.12", "3.13"])})
B("programming",
  q=["how do I {v} an element {p} a set in Python",
     "how can I {v} an element {p} a Python set",
     "what's the way to {v} an element {p} a set in Python"],
  r=["show me how to {v} an element {p} a set in Python"],
  slots={"gc": E("antonym", [{"v": "add", "p": "to"},
                              {"v": "remove", "p": "from"}])})
B("programming",
  q=["how do I get the {fl} {n} items of a list in Python",
     "how can I take the {fl} {n} elements of a Python list",
     "what's the way to slice out the {fl} {n} items of a list in Python"],
  r=["show me how to get the {fl} {n} items of a list in Python"],
  clause="without modifying the original list",
  slots={"fl": E("scope", ["first", "last"]),
         "n": N([2, 3, 4, 5, 10])})
B("programming",
  q=["how do I find the {mm} value in a JavaScript array",
     "how can I get the {mm} number in an array in JavaScript",
     "what's the way to find the {mm} value of a JavaScript array"],
  r=["show me how to find the {mm} value in a JavaScript array"],
  slots={"mm": E("scope", ["minimum", "maximum"])})
B("programming",
  q=["how do I check if a key {ii} in a dictionary in Python",
     "how can I test whether a key {ii} in a Python dict",
     "what's the way to tell if a key {ii} in a dictionary in Python"],
  r=["show me how to check if a key {ii} in a dictionary in Python"],
  slots={"ii": E("negation", ["is", "is not"])})
B("programming",
  q=["how do I select rows where a column {ii} null in SQL",
     "what's the SQL to get rows where a column {ii} null",
     "how can I filter for rows where a column {ii} null in SQL"],
  r=["write a SQL query that selects rows where a column {ii} null"],
  slots={"ii": E("negation", ["is", "is not"])})
B("programming",
  q=["how do I merge the {x} branch into {y} in git",
     "what's the git command to merge the {x} branch into {y}",
     "how can I merge branch {x} into branch {y} with git"],
  r=["show me how to merge the {x} branch into {y} in git"],
  swaps=[Swap("role_swap", "x", "y", pairs=[("feature", "main"),
                                            ("develop", "main"),
                                            ("main", "release")])])
B("programming",
  q=["how do I copy a file from {x} to {y} with scp",
     "what's the scp command to copy a file from {x} to {y}",
     "how can I use scp to copy a file from {x} to {y}"],
  r=["show me the scp command to copy a file from {x} to {y}"],
  swaps=[Swap("direction", "x", "y", pairs=[("my laptop", "a remote server")])])
B("programming",
  q=["how do I initialize an empty hash map in {lang}",
     "how can I initialize an empty hash map in {lang}",
     "what's the way to initialize an empty hash map in {lang}"],
  r=["show me how to initialize an empty hash map in {lang}"],
  slots={"lang": E("entity", LANGS)})
B("programming",
  q=["how do I serialize an object to JSON in {lang}",
     "how can I serialize an object to JSON in {lang}",
     "what's the way to serialize an object as JSON in {lang}"],
  r=["show me how to serialize an object to JSON in {lang}"],
  slots={"lang": E("entity", LANGS)})
B("programming",
  q=["how do I change the background color of a div in CSS",
     "how can I set the background color of a div with CSS",
     "what's the CSS to change a div's background color"],
  r=["show me how to change the background color of a div in CSS"])


# --------------------------------------------------------------------------
# surface variation
# --------------------------------------------------------------------------
GREETINGS = ["", "", "", "", "Hi, ", "Hello, ", "Hey, ", "Hi! ", "Hello! ",
             "Good morning! ", "Hey there, "]
CONTEXTS = ["", "", "", "", "Quick question: ", "I have a question. ",
            "I've been wondering about this. ",
            "I couldn't find a clear answer online. ", "Question: ",
            "Just curious: "]
POLITE_PRE = ["Please help: ", "Sorry to bother you, but ", "Excuse me, ",
              "If you don't mind, ", "I'd really appreciate your help. ",
              "Would you be so kind as to help me? "]
POLITE_SUF = [" Thank you!", " Thanks so much.", " Thanks in advance!",
              " Many thanks.", " I'd be grateful for any help.",
              " Thank you for your time."]
STARTERS = set("""how what what's which when where why who can could should do
does did is are am will would must if in at on for from with without before
after while during explain tell show walk give list calculate work convert
summarize summarise describe recommend suggest find estimate write name
please quick question just sorry excuse as to by roughly about
approximately using""".split())

US2UK = {"traveling": "travelling", "traveler": "traveller",
         "canceled": "cancelled", "canceling": "cancelling",
         "license": "licence", "authorized": "authorised",
         "centimeters": "centimetres", "kilometers": "kilometres",
         "kilometer": "kilometre", "centimeter": "centimetre",
         "pediatrician": "paediatrician", "anemia": "anaemia",
         "yogurt": "yoghurt", "center": "centre", "flavorful": "flavourful",
         "flavor": "flavour", "summarize": "summarise", "color": "colour",
         "organize": "organise", "fiber": "fibre", "enroll": "enrol",
         "counselor": "counsellor", "labor": "labour",
         "sulfuric": "sulphuric", "aluminum": "aluminium",
         "initialize": "initialise", "serialize": "serialise",
         "jewelry": "jewellery", "catalog": "catalogue",
         "checkups": "check-ups"}
# "program" -> "programme" only where it means a course of study
US2UK_DOMAIN = {"education": {"program": "programme"}}


def spell_map(domain, to):
    m = dict(US2UK)
    m.update(US2UK_DOMAIN.get(domain, {}))
    if to == "us":
        m = {v: k for k, v in m.items()}
    return m


def respell(text, domain, to):
    m = spell_map(domain, to)
    if not m:
        return text
    pat = re.compile(r"\b(" + "|".join(sorted((re.escape(k) for k in m),
                                              key=lambda s: (-len(s), s)))
                     + r")\b", re.IGNORECASE)

    def rep(mo):
        w = mo.group(0)
        out = m[w.lower()]
        if w.isupper():
            return out.upper()
        if w[0].isupper():
            return out[0].upper() + out[1:]
        return out
    return pat.sub(rep, text)


def cap(s):
    return s[:1].upper() + s[1:] if s else s


def first_word(s):
    mo = re.match(r"[A-Za-z']+", s)
    return mo.group(0).lower() if mo else ""


def decap(s):
    if first_word(s) in STARTERS and s[:1].isupper() and not s[:2].isupper():
        return s[:1].lower() + s[1:]
    return s


def _check_starters():
    """Every frame/clause must start with a word decap() knows how to lower."""
    firsts = set()
    for b in BASES:
        for t in b.q + b.r + ([b.clause] if b.clause else []):
            firsts.add(first_word(t))
    for t in CONTEXTS + POLITE_PRE:
        if t:
            firsts.add(first_word(t))
    missing = sorted(w for w in firsts if w not in STARTERS
                     and w not in ("i", "i'd", "i've", "i'm"))
    assert not missing, "add to STARTERS: %s" % missing


def an_for(word):
    w = word.lower()
    if w[:1].isdigit():
        return bool(re.match(r"(8|1[18](?!\d))", w))
    if w.startswith(("uni", "use", "usu", "one", "eu")):
        return False
    if w.startswith(("hour", "honest", "heir")):
        return True
    return w[:1] in "aeiou"


def fix_articles(s):
    return re.sub(r"\b([Aa])~ (\S+)",
                  lambda mo: (mo.group(1) + ("n " if an_for(mo.group(2))
                                             else " ") + mo.group(2)), s)


class Inst:
    """One instantiation of a base question: chosen slot values and surface."""

    def __init__(self, base, rng):
        self.base = base
        self.sel = {n: s.pick(rng) for n, s in base.slots.items()}
        self.sw = [sw.pick(rng) for sw in base.swaps]
        self.form = "r" if (base.r and rng.random() < 0.3) else "q"
        self.tidx = rng.randrange(len(self.templates()))
        self.cpos = rng.choice(["end", "end", "front"]) if base.clause else None
        self.num = rng.choice(["d", "d", "w"])
        self.spell = "uk" if rng.random() < 0.2 else "us"
        self.greet = rng.choice(GREETINGS)
        self.ctx = rng.choice(CONTEXTS)

    def copy(self, **kw):
        o = Inst.__new__(Inst)
        o.__dict__.update(self.__dict__)
        o.sel = dict(self.sel)
        o.sw = [list(p) for p in self.sw]
        o.__dict__.update(kw)
        return o

    def templates(self, form=None):
        return self.base.q if (form or self.form) == "q" else self.base.r

    def mapping(self):
        mp = {}
        for n, s in self.base.slots.items():
            i = self.sel[n]
            if isinstance(s, N):
                mp[n] = s.render(i, self.num)
            else:
                v = s.values[i]
                mp[n] = v
                if isinstance(v, dict):
                    mp.update(v)
        for sw, (x, y) in zip(self.base.swaps, self.sw):
            mp[sw.k1], mp[sw.k2] = x, y
        return mp

    def core(self):
        b = self.base
        mp = self.mapping()
        main = self.templates()[self.tidx].format(**mp)
        if b.clause:
            cl = b.clause.format(**mp)
            if self.cpos == "end":
                text = main + " " + cl
            else:
                text = cap(cl) + ", " + decap(main)
        else:
            text = main
        text = fix_articles(text)
        text = cap(text) + ("?" if self.form == "q" else ".")
        if self.spell == "uk":
            text = respell(text, b.domain, "uk")
        return text

    def wrap(self, core, greet=None, ctx=None):
        greet = self.greet if greet is None else greet
        ctx = self.ctx if ctx is None else ctx
        out = greet
        for piece in (ctx, core):
            if not piece:
                continue
            if out.endswith(", "):
                piece = decap(piece)
            out += piece
        return out

    def text(self):
        return self.wrap(self.core())


# --------------------------------------------------------------------------
# hit transformations
# --------------------------------------------------------------------------
NUMBER_WORDS = set(ONES + TENS[2:] + ["hundred", "thousand"] +
                   list(ORD_IRREG.values()))


def build_vocab():
    words = set()

    def add(s):
        words.update(re.findall(r"[a-z]+", s.lower()))

    def add_val(v):
        if isinstance(v, dict):
            for x in v.values():
                add_val(x)
        elif isinstance(v, str):
            add(v)
    for b in BASES:
        for t in b.q + b.r + [b.clause or ""]:
            add(t)
        for s in b.slots.values():
            for v in getattr(s, "values", []):
                add_val(v)
        for sw in b.swaps:
            for p in (sw.pairs or []):
                for v in p:
                    add_val(v)
            for v in (sw.pool or []):
                add_val(v)
    for lst in (GREETINGS, CONTEXTS, POLITE_PRE, POLITE_SUF):
        for s in lst:
            add(s)
    for k, v in list(US2UK.items()) + [("program", "programme")]:
        add(k)
        add(v)
    add(COMMON_WORDS)
    return words


# real words a one-letter edit of the corpus vocabulary could produce
COMMON_WORDS = """plants planes planet fiends friends untied united causal
casual trial trail diary dairy angle angel marital martial sacred scared
petrol patrol decent descent desert dessert lose loose quite quiet costumer
customer breath breathe advice advise affect effect accept except device
devise later latter whether weather thorough through though tough rout route
stationary stationery complement compliment principal principle dinner diner
supper super hoping hopping planing planning filing filling later taping
tapping moping mopping lightning lightening emigrate immigrate formally
formerly cloths clothes medal meddle metal mettle peddle pedal wonder wander
sever severe rein reign wining winning writing written biding bidding
coping copping scrapping scraping stripping striping baring barring
caring carring staring starring fried fired silver sliver tried tired
tiered bared beard regal lager large trade tread dairies diaries expect
except expand expend conversation conservation casualty causality
recommend commend remit submit sever server reverse revere revers
convert covert contact contract relay rely realy really boarder border
laps lapse pours porous""".replace("\n", " ")

TYPO_STOP = NUMBER_WORDS | {"celsius", "fahrenheit"}


def typo_word(w, rng, vocab):
    ops = []
    n = len(w)
    for i in range(1, n - 1):
        ops.append(("drop", i))
    for i in range(1, n - 2):
        if w[i] != w[i + 1]:
            ops.append(("swap", i))
    for i in range(1, n - 1):
        if w[i] != w[i - 1] and w[i] != w[i + 1] and w[i].isalpha():
            ops.append(("double", i))
    rng.shuffle(ops)
    for op, i in ops:
        if op == "drop":
            out = w[:i] + w[i + 1:]
        elif op == "swap":
            out = w[:i] + w[i + 1] + w[i] + w[i + 2:]
        else:
            out = w[:i] + w[i] + w[i:]
        if out.lower() not in vocab and out != w:
            return out
    return None


def make_typo(core, rng, vocab):
    words = re.findall(r"(?<![\w'~-])([a-z]{7,})(?![\w'-])", core)
    cands = sorted(set(w for w in words if w not in TYPO_STOP))
    rng.shuffle(cands)
    for w in cands:
        t = typo_word(w, rng, vocab)
        if t:
            return re.sub(r"(?<![\w'-])" + w + r"(?![\w'-])", t, core, count=1)
    return None


REQUEST_VERBS = {"explain", "tell", "show", "walk", "give", "list", "calculate",
                 "work", "convert", "summarize", "summarise", "describe",
                 "recommend", "suggest", "find", "estimate", "write", "name"}


def make_polite(inst, core, rng):
    mode = rng.choice(["pre", "suf", "both", "please"])
    if mode == "please" and first_word(core) not in REQUEST_VERBS:
        mode = "both"
    if mode == "please":
        return "Please " + decap(core)
    out = core
    if mode in ("pre", "both"):
        pre = rng.choice(POLITE_PRE)
        out = pre + (decap(out) if pre.endswith((", ", "but ")) else out)
    if mode in ("suf", "both"):
        out = out + rng.choice(POLITE_SUF)
    return out


def casing_ops(s, rng):
    def strip_end(x):
        return x.rstrip("?.!")
    ops = [
        lambda x: x.lower(),
        lambda x: strip_end(x.lower()),
        lambda x: x.upper(),
        strip_end,
        lambda x: strip_end(x) + ("??" if x.endswith("?") else "!"),
        lambda x: strip_end(x) + ("?!" if x.endswith("?") else " !"),
        lambda x: x.replace(",", ""),
        lambda x: strip_end(x) + " " + x[len(strip_end(x)):],
        lambda x: x[:1].lower() + x[1:],
        lambda x: x.replace(",", "").lower(),
    ]
    for _ in range(10):
        k = rng.randrange(len(ops))
        out = ops[k](s)
        if rng.random() < 0.3:
            out = ops[rng.randrange(len(ops))](out)
        out = out.strip()
        if out and out != s:
            return out
    return None


# --------------------------------------------------------------------------
# pair generation
# --------------------------------------------------------------------------
def hit_pair(kind, inst, rng, vocab):
    b = inst.base
    if kind == "paraphrase":
        if len(inst.templates()) < 2:
            inst = inst.copy(form="q", tidx=rng.randrange(len(b.q)))
        ts = inst.templates()
        if len(ts) < 2:
            return None
        j = rng.choice([k for k in range(len(ts)) if k != inst.tidx])
        return inst.text(), inst.copy(tidx=j).text()
    if kind == "spelling":
        us, uk = inst.copy(spell="us"), inst.copy(spell="uk")
        a, bb = us.text(), uk.text()
        if a == bb:
            return None
        return (a, bb) if rng.random() < 0.5 else (bb, a)
    if kind == "numeral":
        if not b.has_numeral():
            return None
        d, w = inst.copy(num="d"), inst.copy(num="w")
        a, bb = d.text(), w.text()
        if a == bb:
            return None
        return (a, bb) if rng.random() < 0.5 else (bb, a)
    if kind == "politeness":
        plain = inst.copy(ctx="")
        core = plain.core()
        polite = plain.wrap(make_polite(plain, core, rng))
        a = plain.wrap(core)
        return (a, polite) if rng.random() < 0.6 else (polite, a)
    if kind == "typo":
        core = inst.core()
        t = make_typo(core, rng, vocab)
        if not t:
            return None
        return inst.wrap(core), inst.wrap(t)
    if kind == "reorder":
        if not b.clause:
            return None
        e, f = inst.copy(cpos="end"), inst.copy(cpos="front")
        return (e.text(), f.text()) if rng.random() < 0.5 else (f.text(), e.text())
    if kind == "request_form":
        if not b.r:
            return None
        qi = inst.copy(form="q", tidx=rng.randrange(len(b.q)))
        ri = inst.copy(form="r", tidx=rng.randrange(len(b.r)))
        return (qi.text(), ri.text()) if rng.random() < 0.6 else (ri.text(), qi.text())
    if kind == "casing_punctuation":
        a = inst.text()
        bb = casing_ops(a, rng)
        return (a, bb) if bb else None
    raise ValueError(kind)


def trap_pair(kind, inst, rng):
    ops = inst.base.trap_ops().get(kind)
    if not ops:
        return None
    how, ref = rng.choice(ops)
    other = inst.copy()
    if how == "slot":
        other.sel[ref] = inst.base.slots[ref].alt(rng, inst.sel[ref])
    elif how == "swap":
        x, y = other.sw[ref]
        other.sw[ref] = [y, x]
    else:  # swapalt: replace one side of a pool swap by another pool value
        sw = inst.base.swaps[ref]
        x, y = other.sw[ref]
        new = rng.choice([p for p in sw.pool if p != x and p != y])
        other.sw[ref] = [x, new] if rng.random() < 0.5 else [new, y]
    # mostly the same frame; sometimes another paraphrase frame on one side
    if rng.random() < 0.3 and len(other.templates()) > 1:
        other.tidx = rng.choice([k for k in range(len(other.templates()))
                                 if k != inst.tidx])
    a, b = inst.text(), other.text()
    if a == b:
        return None
    return a, b


def generate(rng):
    vocab = build_vocab()
    pool = {k: {d: [] for d in DOMAINS} for k in HIT_KINDS + TRAP_KINDS}
    for base in BASES:
        for _ in range(8):
            inst = Inst(base, rng)
            for kind in HIT_KINDS:
                p = hit_pair(kind, inst, rng, vocab)
                if p:
                    pool[kind][base.domain].append(p)
            for kind in TRAP_KINDS:
                p = trap_pair(kind, inst, rng)
                if p:
                    pool[kind][base.domain].append(p)
    seen = set()
    rows = []
    for kind in HIT_KINDS + TRAP_KINDS:
        label = "hit" if kind in HIT_KINDS else "trap"
        queues = {}
        for d in DOMAINS:
            lst = list(pool[kind][d])
            rng.shuffle(lst)
            queues[d] = lst
        order = list(DOMAINS)
        rng.shuffle(order)
        taken = 0
        while taken < PER_KIND and any(queues[d] for d in order):
            for d in order:
                if taken >= PER_KIND:
                    break
                while queues[d]:
                    a, b = queues[d].pop()
                    key = (a.strip().lower(), b.strip().lower())
                    if a == b or key in seen or key[::-1] in seen:
                        continue
                    seen.add(key)
                    rows.append({"a": a, "b": b, "label": label,
                                 "kind": kind, "domain": d,
                                 "source": "templated"})
                    taken += 1
                    break
    rng.shuffle(rows)
    return rows


# --------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------
MIN_PER_KIND = 50
MIN_TOTAL = 900
MIN_PER_DOMAIN = 40
MIN_PER_DOMAIN_LABEL = 15


def check(rows):
    by_kind = collections.Counter(r["kind"] for r in rows)
    by_label = collections.Counter(r["label"] for r in rows)
    by_dom = collections.Counter(r["domain"] for r in rows)
    by_dom_label = collections.Counter((r["domain"], r["label"]) for r in rows)
    problems = []
    if len(rows) < MIN_TOTAL:
        problems.append("total %d < %d" % (len(rows), MIN_TOTAL))
    for k in HIT_KINDS + TRAP_KINDS:
        if by_kind[k] < MIN_PER_KIND:
            problems.append("kind %s: %d < %d" % (k, by_kind[k], MIN_PER_KIND))
    for d in DOMAINS:
        if by_dom[d] < MIN_PER_DOMAIN:
            problems.append("domain %s: %d" % (d, by_dom[d]))
        for lab in ("hit", "trap"):
            if by_dom_label[(d, lab)] < MIN_PER_DOMAIN_LABEL:
                problems.append("domain %s/%s: %d"
                                % (d, lab, by_dom_label[(d, lab)]))
    keys = [(r["a"], r["b"]) for r in rows]
    if len(set(keys)) != len(keys):
        problems.append("duplicate (a, b) pairs")
    for r in rows:
        if set(r) != {"a", "b", "label", "kind", "domain", "source"}:
            problems.append("bad keys")
        if (r["label"] == "hit") != (r["kind"] in HIT_KINDS):
            problems.append("label/kind mismatch")
        if r["domain"] not in DOMAINS or r["source"] != "templated":
            problems.append("bad domain/source")
    return by_kind, by_label, by_dom, by_dom_label, problems


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "templated.jsonl"))
    args = ap.parse_args()
    _check_starters()
    rng = random.Random(SEED)
    rows = generate(rng)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    by_kind, by_label, by_dom, by_dom_label, problems = check(rows)
    print("wrote %d pairs to %s" % (len(rows), args.out))
    print("labels:", dict(sorted(by_label.items())))
    print("kinds:", ", ".join("%s=%d" % (k, by_kind[k])
                              for k in HIT_KINDS + TRAP_KINDS))
    print("domains (hit/trap):", ", ".join(
        "%s=%d/%d" % (d, by_dom_label[(d, "hit")], by_dom_label[(d, "trap")])
        for d in DOMAINS))
    if problems:
        print("CHECK FAILED:", "; ".join(problems))
        raise SystemExit(1)
    print("check ok")


if __name__ == "__main__":
    main()
