"""Writes the shipped training corpus (stories.txt, dialogues.jsonl, unicode.txt) next to this file.

All text comes from the small grammars below (written for pdserve), drawn with a fixed seed,
so the corpus is reproducible: `python tools/corpus/generate.py`. The files are
committed so that tokenizer training and the default model never depend on this script's
randomness across Python versions.

- stories.txt: simple children's stories in plain English, one per paragraph block,
  separated by a blank line.
- dialogues.jsonl: short user/assistant chats (facts, arithmetic, greetings, story requests),
  one JSON list of messages per line.
- unicode.txt: sentences with accents, CJK, emoji and symbols, so byte-level tokenizers
  learn multi-byte merges and tests can exercise them.
"""
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------- vocabulary

GIRLS = ["Lily", "Mia", "Emma", "Sara", "Anna", "Lucy", "Zoe", "Ella", "Rosa", "Nora", "Ruby", "Ivy", "Maya", "Lena"]
BOYS = ["Tom", "Ben", "Sam", "Leo", "Max", "Jack", "Finn", "Noah", "Omar", "Theo", "Eli", "Kai", "Hugo", "Milo"]
# (kind, sound, food, home) for animal characters
ANIMALS = [
    ("cat", "meow", "fish", "a warm basket"), ("dog", "woof", "bones", "a little kennel"),
    ("rabbit", "squeak", "carrots", "a cozy burrow"), ("bird", "tweet", "seeds", "a nest in a tall tree"),
    ("fox", "yip", "berries", "a den under the hill"), ("bear", "growl", "honey", "a big cave"),
    ("duck", "quack", "bread crumbs", "a pond"), ("owl", "hoot", "mice", "a hole in an old oak"),
    ("mouse", "squeak", "cheese", "a tiny hole in the wall"), ("frog", "ribbit", "flies", "a lily pad"),
    ("horse", "neigh", "hay", "a barn"), ("cow", "moo", "grass", "a barn"), ("pig", "oink", "apples", "a muddy pen"),
    ("sheep", "baa", "grass", "a green field"), ("turtle", "hiss", "leaves", "the river bank"),
    ("squirrel", "chatter", "nuts", "a hollow tree"), ("lion", "roar", "meat", "the grassland"),
    ("monkey", "ooh ooh", "bananas", "the jungle"), ("goat", "bleat", "weeds", "a rocky hill"),
    ("hen", "cluck", "corn", "a coop"),
]
ANIMAL_NAMES = ["Pip", "Bella", "Coco", "Rex", "Daisy", "Buddy", "Luna", "Toby", "Penny", "Bruno", "Hazel", "Oscar",
                "Willow", "Pebble", "Sunny", "Maple", "Rusty", "Clover", "Biscuit", "Juniper"]
ADJ_CHAR = ["little", "kind", "brave", "curious", "shy", "happy", "clever", "gentle", "silly", "busy", "small", "young"]
PLACES = [
    "in a small village by the sea", "in a big green forest", "in a quiet town near the hills",
    "on a farm with a red barn", "in a busy city", "in a little house on a hill", "in a sunny meadow",
    "in a snowy valley", "near a garden full of flowers", "in a cottage near a river", "in an old castle",
    "on a warm island", "in a town with a tall clock tower",
]
TIMES = ["Once upon a time", "One day", "Long ago", "One sunny morning", "One rainy afternoon",
         "One cold winter day", "Early one spring morning", "One summer evening", "Last week", "One windy day"]
TOYS = ["ball", "kite", "teddy bear", "toy boat", "toy car", "doll", "puzzle", "yo-yo", "wooden train", "sun hat",
        "book", "drum", "paper plane", "music box", "shiny stone"]
COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "brown", "gold"]
HIDING = ["under the bed", "behind the sofa", "in the tall grass", "under a big leaf", "next to the pond",
          "in the toy box", "on top of the shelf", "under the old tree", "in the garden", "near the gate"]
FOODS = ["a cake", "cookies", "soup", "bread", "a pie", "pancakes", "a fruit salad", "muffins", "a sandwich", "jam"]
FEELINGS_GOOD = ["happy", "glad", "proud", "excited", "cheerful", "thankful"]
FEELINGS_BAD = ["sad", "worried", "scared", "upset", "lonely", "tired", "grumpy"]
WEATHER = ["the sun was shining", "it was raining", "the wind was blowing", "snow was falling",
           "the sky was gray", "the sky was clear and blue", "a rainbow was in the sky"]
ACTIVITIES = ["play tag", "build a sandcastle", "fly a kite", "paint a picture", "plant flowers", "read a book",
              "sing songs", "ride bikes", "play hide and seek", "build a fort", "go for a walk", "have a picnic",
              "splash in puddles", "look at the stars", "make a snowman", "jump rope"]
MORALS = [
    "It is good to share with friends.", "Being kind makes everyone happy.", "Friends help each other.",
    "It is okay to ask for help.", "Trying again is how we learn.", "Telling the truth is always best.",
    "Patience is a good friend.", "Even small friends can do big things.", "Listening is a kind thing to do.",
    "A good friend is a great treasure.",
]


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class Char:
    """A story character with the pronouns that agree with it."""

    def __init__(self, rng: random.Random, exclude: str = ""):
        roll = rng.random()
        adj = rng.choice(ADJ_CHAR)
        if roll < 0.35:
            self.name, self.he, self.him, self.his = rng.choice([g for g in GIRLS if g != exclude]), "she", "her", "her"
            self.kind = "girl"
        elif roll < 0.7:
            self.name, self.he, self.him, self.his = rng.choice([b for b in BOYS if b != exclude]), "he", "him", "his"
            self.kind = "boy"
        else:
            animal = rng.choice(ANIMALS)
            self.kind, self.sound, self.food, self.home = animal
            self.name = rng.choice([n for n in ANIMAL_NAMES if n != exclude])
            self.he, self.him, self.his = ("she", "her", "her") if rng.random() < 0.5 else ("he", "him", "his")
        self.intro = f"{article(adj)} {adj} {self.kind} named {self.name}"
        self.animal = self.kind not in ("girl", "boy")

    @property
    def He(self):
        return self.he.capitalize()

    @property
    def His(self):
        return self.his.capitalize()


def pick(rng, *options):
    return rng.choice(options)


# ---------------------------------------------------------------- story plots

def plot_lost_toy(rng, a, b):
    toy = rng.choice(TOYS)
    color = rng.choice(COLORS)
    where, wrong = rng.sample(HIDING, 2)
    sad = rng.choice(FEELINGS_BAD)
    return [
        f"{a.name} had a {color} {toy}. {a.He} loved it very much and played with it every day.",
        f"But one day, the {toy} was gone. {a.name} looked {wrong}, but it was not there.",
        f"{a.name} felt {sad}. {pick(rng, 'Tears came to ' + a.his + ' eyes.', a.He + ' sat down and sighed.')}",
        f"Then {a.name} saw {b.name}. \"Why are you {sad}?\" asked {b.name}.",
        f"\"I lost my {toy},\" said {a.name}. \"Can you help me find it?\"",
        f"\"Yes, I will help you,\" said {b.name}. They looked together.",
        f"At last, {b.name} found the {toy} {where}. \"Here it is!\" {b.he} said.",
        f"{a.name} was so {rng.choice(FEELINGS_GOOD)}. \"Thank you, {b.name}!\" {a.he} said, and gave {b.him} a big hug.",
    ]


def plot_share_food(rng, a, b):
    food = rng.choice(FOODS)
    return [
        f"{a.name} and {a.his} {pick(rng, 'mom', 'dad', 'grandma', 'grandpa')} made {food} in the kitchen.",
        f"It smelled very good. {a.name} wanted to eat it all by {a.him}self.",
        f"Then {b.name} came to the door. {b.He} looked hungry and {rng.choice(FEELINGS_BAD)}.",
        f"{a.name} thought for a moment. Then {a.he} said, \"Would you like some?\"",
        f"\"Yes, please!\" said {b.name}. They sat at the table and ate {food} together.",
        f"It tasted even better with a friend. {a.name} felt warm and {rng.choice(FEELINGS_GOOD)} inside.",
    ]


def plot_activity(rng, a, b):
    act = rng.choice(ACTIVITIES)
    weather = rng.choice(WEATHER)
    return [
        f"{a.name} wanted to {act}, but {a.he} did not know how.",
        f"{a.He} tried once, and it did not work. {a.He} tried again, and it still did not work.",
        f"{a.name} felt {rng.choice(FEELINGS_BAD)}. \"This is too hard,\" {a.he} said.",
        f"{b.name} saw {a.him} and came over. \"Let me show you,\" said {b.name}.",
        f"{b.name} showed {a.name} what to do, step by step. {a.name} watched and listened.",
        f"Then {a.name} tried one more time, and it worked! Outside, {weather}.",
        f"\"I did it!\" {a.name} shouted. {a.He} and {b.name} were very {rng.choice(FEELINGS_GOOD)}.",
        f"After that, they liked to {act} together every day.",
    ]


def plot_animal_home(rng, a, b):
    kind, sound, food, home = rng.choice(ANIMALS)
    return [
        f"One day, {a.name} found a little {kind} in the {pick(rng, 'garden', 'park', 'woods', 'street', 'yard')}.",
        f"The {kind} was lost and {rng.choice(FEELINGS_BAD)}. It said, \"{sound.capitalize()}, {sound}!\"",
        f"{a.name} asked {b.name}, \"Where does a {kind} live?\" {b.name} said, \"A {kind} lives in {home}.\"",
        f"So they gave the {kind} some {food}, and it ate it all up.",
        f"Then {a.name} and {b.name} took the {kind} back to {home}.",
        f"The {kind}'s family was there. They were so {rng.choice(FEELINGS_GOOD)} to see it again.",
        f"\"{sound.capitalize()}!\" said the little {kind}. It was its way of saying thank you.",
    ]


def plot_fear(rng, a, b):
    scary = rng.choice(["the dark", "thunder", "the big dog next door", "the deep water", "the tall slide",
                        "the noise in the attic", "the first day of school"])
    return [
        f"{a.name} was scared of {scary}. {a.He} did not like it at all.",
        f"One night, {a.name} told {b.name}, \"I am scared of {scary}.\"",
        f"{b.name} smiled. \"I was scared of it too, once,\" {b.he} said. \"But then I learned it is not so bad.\"",
        f"{b.name} held {a.name}'s hand. Together they were brave.",
        f"Soon {a.name} was not scared anymore. {a.He} even laughed.",
        f"\"Thank you for being with me,\" said {a.name}. \"That is what friends are for,\" said {b.name}.",
    ]


def plot_gift(rng, a, b):
    color, toy = rng.choice(COLORS), rng.choice(TOYS)
    return [
        f"It was {b.name}'s birthday. {a.name} wanted to give {b.him} a gift.",
        f"But {a.name} had no money. {a.He} thought and thought.",
        f"Then {a.he} had an idea. {a.He} would make a gift with {a.his} own hands.",
        f"{a.name} made a {color} {toy} out of paper, string and glue. It took a long time.",
        f"At the party, {a.name} gave the {toy} to {b.name}. \"I made it for you,\" {a.he} said.",
        f"{b.name} loved it. \"This is the best gift of all,\" {b.he} said, \"because you made it.\"",
        f"{a.name} felt very {rng.choice(FEELINGS_GOOD)}.",
    ]


def plot_weather_day(rng, a, b):
    act, act2 = rng.sample(ACTIVITIES, 2)
    return [
        f"In the morning, {a.name} wanted to {act} with {b.name}.",
        f"But when {a.he} looked out the window, {pick(rng, 'it was raining hard', 'the wind was too strong', 'snow covered the ground')}.",
        f"\"Oh no,\" said {a.name}. \"Now we cannot {act}.\"",
        f"\"Don't be {rng.choice(FEELINGS_BAD)},\" said {b.name}. \"We can {act2} instead.\"",
        "So they did. They had so much fun that they forgot about the weather.",
        f"When the day was over, {a.name} said, \"That was a good day after all.\"",
    ]


def plot_animal_friend(rng, a, b):
    # The hero is an animal if possible; speaks of food and home.
    if not a.animal and not b.animal:
        return plot_lost_toy(rng, a, b)
    if not a.animal:
        a, b = b, a
    return [
        f"{a.name} the {a.kind} lived in {a.home}. Every morning {a.he} ate {a.food}.",
        f"One day, {a.name} met {b.name}, who was {b.intro.split(' named ')[0]}.",
        f"\"{a.sound.capitalize()}!\" said {a.name}. \"Hello!\" said {b.name}. \"Do you want to be my friend?\"",
        f"{a.name} was {pick(rng, 'shy', 'not sure', 'a little afraid')} at first. But {b.name} was kind.",
        "They played all day. They ran, they jumped, and they laughed.",
        f"When the sun went down, {a.name} went back to {a.home}. {a.He} could not wait to play again tomorrow.",
    ]


PLOTS = [plot_lost_toy, plot_share_food, plot_activity, plot_animal_home, plot_fear, plot_gift, plot_weather_day,
         plot_animal_friend]


def story(rng: random.Random) -> str:
    a = Char(rng)
    b = Char(rng, exclude=a.name)
    opening = f"{rng.choice(TIMES)}, there was {a.intro}. {a.He} lived {rng.choice(PLACES)}."
    if a.animal and rng.random() < 0.5:
        opening += f" {a.He} liked to eat {a.food}."
    friend = f"{a.name} had a friend named {b.name}." if rng.random() < 0.5 else f"{a.His} best friend was {b.name}."
    body = rng.choice(PLOTS)(rng, a, b)
    ending = pick(rng, "The end.", rng.choice(MORALS), f"From that day on, {a.name} and {b.name} were the best of friends.",
                  f"And {a.name} always remembered that day.")
    return " ".join([opening, friend] + body + [ending])


# ---------------------------------------------------------------- dialogues

SKY = [("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"), ("an orange", "orange"),
       ("a strawberry", "red"), ("coal", "black"), ("the sun", "yellow"), ("a lemon", "yellow"), ("chocolate", "brown")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("day", "night"),
             ("open", "closed"), ("old", "new"), ("wet", "dry"), ("tall", "short"), ("light", "dark"), ("full", "empty")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def dialogue(rng: random.Random) -> list[dict]:
    kind = rng.randrange(9)
    if kind == 0:
        thing, color = rng.choice(SKY)
        q = pick(rng, f"What color is {thing}?", f"Can you tell me the color of {thing}?")
        a = f"{thing[0].upper() + thing[1:]} is {color}."
    elif kind == 1:
        animal, sound, food, home = rng.choice(ANIMALS)
        which = rng.randrange(3)
        if which == 0:
            q, a = f"What sound does a {animal} make?", f"A {animal} says \"{sound}\"."
        elif which == 1:
            q, a = f"What does a {animal} eat?", f"A {animal} likes to eat {food}."
        else:
            q, a = f"Where does a {animal} live?", f"A {animal} lives in {home}."
    elif kind == 2:
        x, y = rng.randrange(11), rng.randrange(11)
        if rng.random() < 0.5:
            q, a = f"What is {x} plus {y}?", f"{x} plus {y} is {x + y}."
        else:
            x, y = max(x, y), min(x, y)
            q, a = f"What is {x} minus {y}?", f"{x} minus {y} is {x - y}."
    elif kind == 3:
        word, opp = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            word, opp = opp, word
        q, a = f"What is the opposite of {word}?", f"The opposite of {word} is {opp}."
    elif kind == 4:
        i = rng.randrange(7)
        q, a = f"What day comes after {DAYS[i]}?", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."
    elif kind == 5:
        name = rng.choice(GIRLS + BOYS)
        q = pick(rng, "Hello!", "Hi there!", "Good morning!", f"Hello, my name is {name}.")
        a = (f"Hello, {name}! " if name in q else "Hello! ") + pick(
            rng, "How can I help you today?", "It is nice to meet you.", "What would you like to talk about?")
    elif kind == 6:
        n = rng.randrange(1, 21)
        q, a = f"How do you write {n} in words?", f"The number {n} is written as \"{NUMBER_WORDS[n]}\"."
    elif kind == 7:
        q = pick(rng, "Tell me a story.", "Can you tell me a short story?", "Please tell me a story.")
        a = story(rng)
    else:
        q = pick(rng, "Thank you!", "Thanks for your help.", "Goodbye!")
        a = pick(rng, "You are welcome!", "I am happy to help.", "Goodbye! Have a nice day.")
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    return messages


# ---------------------------------------------------------------- unicode

UNICODE_LINES = [
    "Le café est très bon à Paris, même en été.", "¿Dónde está la estación? Está allí, señor.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Schöne Grüße!", "Ça va? Oui, ça va très bien, merci.",
    "São Paulo é uma cidade enorme; a população cresce a cada ano.", "Zürich, Genève et Lausanne sont en Suisse.",
    "Łódź, Kraków i Gdańsk to miasta w Polsce.", "Ångström, smörgåsbord och fika är svenska ord.",
    "Naïve coöperation in the façade of the résumé.", "Ελληνικά: καλημέρα, ευχαριστώ πολύ.",
    "Русский язык: привет, как дела? Спасибо, хорошо.", "日本語のテキスト：こんにちは、元気ですか？",
    "中文文本：你好，世界！今天天气很好。", "我喜欢吃苹果和香蕉。", "東京は日本の首都です。",
    "한국어: 안녕하세요, 만나서 반갑습니다.", "Emoji: 🙂 😀 🎉 🚀 🌍 ❤️ 👍 🐱 🐶 🍕",
    "Family emoji 👨‍👩‍👧 and flags 🇫🇷 🇯🇵 use joiners.", "Math: ∑ x² ≤ ∞, π ≈ 3.14159, √2 ≈ 1.414, ∂f/∂x.",
    "Currency: €5, £3, ¥100, ₹20, ₿0.1.", "Quotes: “double”, ‘single’, «guillemets», and dashes — –.",
    "עברית: שלום עולם.", "العربية: مرحبا بالعالم.", "हिन्दी: नमस्ते दुनिया।", "ไทย: สวัสดีครับ",
    "Tiếng Việt: Xin chào, cảm ơn bạn rất nhiều.", "Türkçe: Günaydın, nasılsınız? Çok teşekkürler.",
]


def unicode_text(rng: random.Random, n: int) -> str:
    # Lines mixed with short English phrases so merges form across scripts and spaces.
    out = []
    for _ in range(n):
        line = rng.choice(UNICODE_LINES)
        if rng.random() < 0.3:
            line = f"{rng.choice(GIRLS + BOYS)} said: {line} {rng.choice(['🙂', '🎉', '👍', '❤️', '🌍'])}"
        out.append(line)
    return "\n".join(out) + "\n"


def main(n_stories: int = 5000, n_dialogues: int = 6000, n_unicode: int = 1500, seed: int = 1234):
    rng = random.Random(seed)
    with open(os.path.join(HERE, "stories.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(story(rng) for _ in range(n_stories)) + "\n")
    with open(os.path.join(HERE, "dialogues.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(n_dialogues):
            f.write(json.dumps(dialogue(rng), ensure_ascii=False) + "\n")
    with open(os.path.join(HERE, "unicode.txt"), "w", encoding="utf-8") as f:
        f.write(unicode_text(rng, n_unicode))


if __name__ == "__main__":
    main()
