"""A small grammar of simple English: stories, animal facts, greetings, dialogues, chat turns.

The training text of the built-in demo model (scripts/train_tiny_model.py). It is generated,
not collected, so the project can ship it and rebuild it offline; ``corpus(n, seed)`` returns
the same documents for the same arguments on every machine (only ``random.Random`` is used).
Plain ASCII, so a byte-level tokenizer trained on it never needs a multi-byte character.
Chat turns use the model maker's template ("role: content" lines, then "assistant:").
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Animal:
    one: str
    many: str
    looks: str
    home: str  # where they live, said of many
    den: str  # where one of them lives
    food: str
    can: str
    sound: str


ANIMALS = (  # one, many, looks, home, den, food, can, sound
    Animal("fox", "foxes", "red fur and a bushy tail", "in the forest", "in the forest",
           "mice and berries", "run very fast", "yip"),
    Animal("cat", "cats", "soft fur and long whiskers", "in warm houses", "in a warm house",
           "fish and milk", "climb tall trees", "meow"),
    Animal("dog", "dogs", "wet noses and waggy tails", "with their families", "with a big family",
           "meat and bones", "smell things from far away", "woof"),
    Animal("bird", "birds", "feathers and small beaks", "in nests in the trees",
           "in a nest in a tree", "seeds and worms", "fly high in the sky", "tweet"),
    Animal("rabbit", "rabbits", "long ears and fluffy tails", "in holes under the ground",
           "in a hole under the ground", "carrots and grass", "hop very quickly", "squeak"),
    Animal("bear", "bears", "thick brown fur", "in caves in the woods", "in a cave in the woods",
           "honey and fish", "stand up on two legs", "growl"),
    Animal("owl", "owls", "big round eyes", "in old trees", "in an old tree",
           "mice and bugs", "see in the dark", "hoot"),
    Animal("frog", "frogs", "green skin and long legs", "near ponds", "near a pond",
           "flies and bugs", "jump very far", "croak"),
    Animal("duck", "ducks", "webbed feet and flat beaks", "on lakes and ponds", "on a lake",
           "plants and seeds", "swim and fly", "quack"),
    Animal("mouse", "mice", "tiny feet and a long tail", "in small holes", "in a small hole",
           "cheese and seeds", "hide in tiny places", "squeak"),
    Animal("horse", "horses", "long legs and a long mane", "on farms", "on a farm",
           "grass and hay", "run for a long time", "neigh"),
    Animal("cow", "cows", "big eyes and black spots", "on farms", "on a farm",
           "grass", "give us milk", "moo"),
    Animal("bee", "bees", "yellow and black stripes", "in hives", "in a hive",
           "nectar from flowers", "make sweet honey", "buzz"),
    Animal("fish", "fish", "shiny scales and fins", "in rivers and in the sea", "in a river",
           "tiny plants", "breathe under water", "blub"),
)
CITIES = ("Paris", "London", "Rome", "Tokyo", "Berlin", "Madrid", "Oslo", "Cairo", "Lima",
          "Sydney")
JSON_ASKS = ("Reply in JSON.", "Answer in JSON.", "Give me a JSON object.", "Reply with JSON.",
             "Tell me about an animal in JSON.")
LEGS = {"bird": 2, "duck": 2, "owl": 2, "fish": 0, "bee": 6}
GIRLS = ("Lily", "Mia", "Anna", "Sara", "Emma", "Lucy", "Zoe", "Rosa", "Amy", "Ella", "Kate",
         "Grace", "Ruby", "Nora", "Alice", "Molly")
BOYS = ("Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Tim", "Finn", "Noah", "Adam", "Oscar",
        "Jake", "Henry", "Peter", "Oliver", "Eli")
# Friends have their own names: a friend's name is then never the hero's, which a tiny model
# trained on one shared list of names learns to get wrong ("Kate showed it to her friend Kate").
PAL_GIRLS = ("Bella", "Daisy", "Poppy", "Rosie", "Luna", "Ivy", "Hazel", "Willow")
PAL_BOYS = ("Milo", "Toby", "Rex", "Buddy", "Otto", "Felix", "Hugo", "Jasper")
KID_ADJS = ("little", "kind", "happy", "brave", "curious", "gentle", "clever", "shy", "funny",
            "young", "cheerful", "friendly")
ANIMAL_ADJS = ("little", "quick", "lazy", "clever", "small", "busy", "fluffy", "sleepy", "hungry",
               "old", "big", "tiny", "young")
COLORS = ("brown", "white", "gray", "black", "golden")
PLACES = ("in a small village", "in a big city", "in a quiet forest", "on a sunny farm",
          "in a house by the sea", "in a little town", "in a green valley", "near a tall mountain",
          "in a house near the park", "by a wide river")
LIKES = (("play in the park", "played in the park"), ("read books", "read books"),
         ("sing songs", "sang songs"), ("paint pictures", "painted pictures"),
         ("climb trees", "climbed trees"), ("run in the grass", "ran in the grass"),
         ("look at the stars", "looked at the stars"), ("build sand castles", "built sand castles"),
         ("fly a kite", "flew a kite"), ("play with a ball", "played with a ball"),
         ("bake cookies", "baked cookies"), ("dance in the rain", "danced in the rain"),
         ("draw animals", "drew animals"), ("swim in the lake", "swam in the lake"),
         ("pick flowers", "picked flowers"), ("play hide and seek", "played hide and seek"))
THINGS = ("a red ball", "a shiny key", "an old map", "a small box", "a blue kite", "a pretty shell",
          "a big apple", "a golden coin", "a little boat", "a yellow hat", "a magic stone",
          "a green bottle", "a soft teddy bear", "a silver bell", "a funny toy car", "a long rope",
          "a purple flower", "a tiny egg")
WHERE = ("in the garden", "under a tree", "near the river", "in the grass", "on the beach",
         "behind the house", "in the park", "next to a big rock", "in the old barn",
         "at the top of the hill")
FEELINGS = ("happy", "surprised", "excited", "curious", "glad", "proud")
FINE = ("fine", "good", "very well", "happy", "great")
WEATHER = ("The sun was shining.", "It was a warm summer day.", "The sky was blue and clear.",
           "It was a cold winter morning.", "The wind was blowing softly.",
           "It was a rainy afternoon.")
# (what went wrong, how the friends fixed it): kept in pairs so the story stays coherent
TROUBLES = (
    ("got stuck in a tall tree", "used a long stick to get it down"),
    ("fell into the pond", "asked a kind duck to push it back to the shore"),
    ("was lost in the tall grass", "looked and looked until they found it"),
    ("broke into two pieces", "fixed it with some glue"),
    ("rolled down the hill", "ran down the hill and caught it"),
    ("was taken by the wind", "ran after it until it came down"),
    ("fell into a deep hole", "tied a rope to a basket and pulled it up"),
    ("was carried away by the river", "ran along the river and got it back"),
)
ENDINGS = ("From that day on, they were best friends.",
           "They played together until the sun went down.",
           "{name} learned that friends help each other.", "It was the best day ever.",
           "{name} smiled and said thank you.", "Then they went home for dinner.",
           "That night, {name} went to bed with a big smile.", "The end.")
GREETINGS = ("Hello! My name is {name}.", "Hello, my name is {name}.", "Hi! I am {name}.",
             "Hello everyone, this is {name}.", "Hello world, this is {name}.",
             "Hello from {name}!")
SPOTS = ("the park", "the river", "the forest", "the beach", "the farm", "the hill", "the lake")


def a_an(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


class StoryGrammar:
    """Each method writes one document of its kind, drawing every choice from ``rng``."""

    def __init__(self, rng: random.Random):
        self.r = rng

    def _hero(self, pal: bool = False) -> tuple[str, str, str, str, Animal | None]:
        """(name, what they are, he/she, his/her, the animal they are or None for a child)."""
        r = self.r
        girl = r.random() < 0.5
        name = r.choice((PAL_GIRLS if girl else PAL_BOYS) if pal else (GIRLS if girl else BOYS))
        animal = r.choice(ANIMALS) if r.random() < 0.35 else None
        what = (f"{r.choice(ANIMAL_ADJS + COLORS)} {animal.one}" if animal
                else f"{r.choice(KID_ADJS)} {'girl' if girl else 'boy'}")
        return name, what, "she" if girl else "he", "her" if girl else "his", animal

    def _opening(self, name: str, what: str, he: str, animal: Animal | None) -> list[str]:
        r = self.r
        if animal is not None and r.random() < 0.4:  # "The quick brown fox named Max ..."
            adjs = r.choice(ANIMAL_ADJS) + (" " + r.choice(COLORS) if r.random() < 0.5 else "")
            return [f"The {adjs} {animal.one} named {name} lived {animal.den}."]
        first = r.choice((f"Once upon a time, there was {a_an(what)} named {name}.",
                          f"Once upon a time, {r.choice(PLACES)}, there lived {a_an(what)} "
                          f"named {name}.",
                          f"There once was {a_an(what)} named {name}."))
        if ", there lived" in first:  # already says where
            return [first]
        return [first, f"{he.capitalize()} lived {animal.den if animal else r.choice(PLACES)}."]

    def story(self) -> str:
        r = self.r
        name, what, he, his, animal = self._hero()
        friend, friend_what, _, _, _ = self._hero(pal=True)
        like, liked = r.choice(LIKES)
        thing = r.choice(THINGS)
        the_thing = "the " + thing.split(" ", 1)[1]
        trouble, fix = r.choice(TROUBLES)
        out = self._opening(name, what, he, animal)
        out.append(f"{name} loved to {like}.")
        if r.random() < 0.5:
            out.append(r.choice(WEATHER))
        out.append(f"One day, {name} found {thing} {r.choice(WHERE)}.")
        out.append(f"{he.capitalize()} was very {r.choice(FEELINGS)}.")
        out.append(f"{name} wanted to show it to {his} friend {friend}, {a_an(friend_what)}.")
        out.append(f"But then, {the_thing} {trouble}.")
        out.append(f"{name} was sad. \"Oh no!\" {he} said.")
        out.append(f"\"Don't worry, I will help you,\" said {friend}.")
        out.append(f"Together they {fix}.")
        out.append(f"{name} and {friend} {liked} all day.")
        out.append(r.choice(ENDINGS).format(name=name))
        return " ".join(out)

    def facts(self, a: Animal, n: int | None = None) -> str:
        many = a.many.capitalize()
        sentences = [f"{many} are animals with {a.looks}.", f"{many} live {a.home}.",
                     f"{many} eat {a.food}.", f"{a_an(a.one).capitalize()} can {a.can}.",
                     f"When {a_an(a.one)} talks, it says {a.sound}."]
        # Always in this order, so the model never has to remember which facts it already said.
        return " ".join(sentences[:1 + (n if n is not None else self.r.randint(2, 4))])

    def dialogue(self) -> str:
        r = self.r
        a, b = r.choice(GIRLS + BOYS), r.choice(PAL_GIRLS + PAL_BOYS)
        like, liked = r.choice(LIKES)
        return " ".join([f"\"Hello, {b}!\" said {a}.", f"\"Hello, {a}!\" said {b}.",
                         "\"How are you today?\"",
                         f"\"I am {r.choice(FINE)}, thank you. Do you want to {like} with me?\"",
                         f"\"Yes, I would love to!\" said {b}.",
                         f"So {a} and {b} {liked} together."])

    def chat(self) -> str:
        r = self.r
        a = r.choice(ANIMALS)
        system = r.choice(("", "", "system: be brief\n", "system: You are a helpful assistant.\n"))
        brief = bool(system) and "brief" in system
        ask, answer = r.choice((
            (f"Tell me about {a.many}", self.facts(a, 1 if brief else None)),
            (f"What do {a.many} eat?", f"{a.many.capitalize()} eat {a.food}."),
            (f"Where do {a.many} live?", f"{a.many.capitalize()} live {a.home}."),
            (f"What does {a_an(a.one)} say?", f"{a_an(a.one).capitalize()} says {a.sound}."),
            ("Tell me a story", self.story()),
            ("Hello", "Hello! How can I help you today?"),
            ("Hi", "Hi! What would you like to talk about?")))
        ask += r.choice((".", "!", "")) if not ask.endswith("?") else ""
        return f"{system}user: {ask}\nassistant: {answer}"

    def friends(self) -> str:
        r = self.r
        a, b = r.choice(GIRLS + BOYS), r.choice(PAL_GIRLS + PAL_BOYS)
        (_, liked), (_, liked2) = r.sample(LIKES, 2)
        spot, animal = r.choice(SPOTS), r.choice(ANIMALS)
        return " ".join([
            f"{a} and {b} were best friends.", f"They lived {r.choice(PLACES)}.",
            f"Every day, they {liked} together.", f"One day, {a} said, \"Let's go to {spot}!\"",
            f"So they walked to {spot}.",
            f"There they saw {a_an(r.choice(ANIMAL_ADJS) + ' ' + animal.one)}.",
            f"The {animal.one} said {animal.sound}!", f"{a} and {b} laughed.",
            f"\"Hello, little {animal.one},\" said {b}.",
            f"The {animal.one} wanted to play, so they {liked2} together.",
            "When the sun went down, they walked home.",
            r.choice(("It was a wonderful day.", "The end.", "What a fun day!"))])

    def about_me(self) -> str:
        r = self.r
        name, what, _, _, animal = self._hero()
        friend = r.choice(PAL_GIRLS + PAL_BOYS)
        (like, _), (like2, _) = r.sample(LIKES, 2)
        out = [r.choice(GREETINGS).format(name=name), f"I am {a_an(what)}.",
               f"I live {animal.den if animal else r.choice(PLACES)}.", f"I love to {like}.",
               f"My best friend is {friend}.", f"We like to {like2} together."]
        if animal is None and r.random() < 0.5:
            pet = r.choice(ANIMALS)
            out.append(f"I have a pet {pet.one}. It says {pet.sound}.")
        out.append(r.choice(("Goodbye!", "See you soon!", "Thank you for reading.")))
        return " ".join(out)

    def json_chat(self) -> str:
        """A chat turn answered in JSON: objects of a few short fields, a list, or a tool call
        (structured outputs on the demo model: it learns to close what it opens, then stop)."""
        r = self.r
        a, name = r.choice(ANIMALS), r.choice(GIRLS + BOYS)
        city = r.choice(CITIES)
        ask, value = r.choice((
            (r.choice(JSON_ASKS), {"animal": a.one, "food": a.food, "sound": a.sound}),
            (f"Describe {a_an(a.one)} as JSON.", {"name": a.one, "looks": a.looks,
                                                   "home": a.den, "legs": LEGS.get(a.one, 4)}),
            ("Describe a person as JSON with name and age.", {"name": name,
                                                               "age": r.randint(3, 90)}),
            (f"Give me a JSON list of {a.many}.", {"animals": [x.many for x in
                                                               r.sample(ANIMALS, 3)]}),
            (f"What is the weather in {city}?", [{"name": "get_weather",
                                                  "arguments": {"city": city}}]),
            (f"What do {a.many} eat? Answer in JSON.", {"answer": f"{a.many} eat {a.food}",
                                                         "sure": r.random() < 0.8})))
        compact = r.random() < 0.7
        text = json.dumps(value) if compact else json.dumps(value, indent=2)
        # A JSON grammar allows no whitespace before the value, so half start right after ':'.
        return f"user: {ask}\nassistant:{r.choice(('', ' '))}{text}"

    def document(self) -> str:
        kinds = (self.story, self.friends, self.about_me, self.dialogue, self.chat, self.facts,
                 self.json_chat)
        kind = self.r.choices(kinds, weights=(40, 12, 10, 10, 16, 12, 8))[0]
        return kind(self.r.choice(ANIMALS)) if kind == self.facts else kind()


def corpus(num_docs: int, seed: int = 0) -> list[str]:
    """num_docs documents (stories, facts, greetings, dialogues, chats, JSON answers), the same for the
    same seed."""
    grammar = StoryGrammar(random.Random(seed))
    return [grammar.document() for _ in range(num_docs)]


if __name__ == "__main__":
    for doc in corpus(6, seed=1):
        print(doc, end="\n\n")
