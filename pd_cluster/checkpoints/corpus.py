"""Built-in English training text for the generated test tokenizers.

Plain ASCII prose on varied topics, so byte-level BPE learns common English
words, punctuation and digits. Changing this text changes every generated
tokenizer (and hence token ids), so bump ``maker.GENERATOR_VERSION`` too.
"""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every
morning he walked down to the harbor, checked his nets, and rowed out past the rocks before the sun
was up. The village was quiet in winter and busy in summer, when travelers came to see the cliffs.

Hello world! How are you today? I am fine, thank you. What time is it? It is half past nine in the
morning, and the train to the city leaves at ten. Please remember to bring your ticket, your keys,
and a warm coat, because the weather report says it will rain this afternoon.

Computers store numbers in binary. A byte holds eight bits, so it can represent 256 different values,
from 0 to 255. Modern processors run billions of instructions per second, and a graphics card can
multiply large matrices in parallel. Memory bandwidth, not arithmetic, is often the real limit.

A language model reads a sequence of tokens and predicts the next one. During prefill the model
processes the whole prompt at once; during decode it produces one token at a time, reusing the keys
and values it cached for earlier positions. Serving systems split these two phases across machines
so that long prompts do not slow down the steady stream of generated text.

The recipe is simple. Mix two cups of flour with a teaspoon of salt. Add one cup of warm water and
a spoonful of oil, then knead the dough for ten minutes until it is smooth. Let it rest for an hour,
shape it into a loaf, and bake it at 220 degrees for about thirty-five minutes.

"Where are we going?" asked the child. "To the library," said her father, "where the books are kept
in long rows, and anyone can read them for free." She smiled, because she loved stories about
dragons, pirates, clever animals, and ships that sailed to the edge of the map.

History teaches that great cities grow near rivers. Water brings trade, food, and travel; bridges
connect neighborhoods; markets appear where roads meet. Over centuries, walls are built and torn
down, streets are widened, and new districts rise where fields once stood.

The committee met on Tuesday to discuss the budget for next year. After a long debate, members agreed
to increase funding for schools and parks, to repair the old bridge on Main Street, and to hire three
new nurses for the public clinic. The final vote was seven to two.

In the garden, tomatoes ripen slowly in the heat of July. Bees move from flower to flower, and small
birds search the soil for seeds and worms. By September the apples are ready, the leaves begin to
turn red and gold, and the evenings grow cool enough for a fire.

Mathematics is the study of patterns. Two plus two equals four; three times seven is twenty-one; the
square root of sixteen is four. A prime number has exactly two divisors: one and itself. The first
few primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. Every even number greater than two is the sum
of two primes, or so the famous conjecture claims.

Dear Sam, thank you for your letter. We were very happy to hear about your new job and your move to
the north. The children ask about you every day. Write again soon, and tell us whether the snow has
started yet. With love, Anna.

Good software is tested, documented, and easy to change. Write small functions with clear names.
Check your inputs, handle errors, and log what happened. When something breaks, read the message,
form a hypothesis, and try the smallest experiment that could prove it wrong.

The ocean covers most of the surface of the planet. Its currents carry heat from the equator toward
the poles, and its tides rise and fall twice a day under the pull of the moon. Whales sing across
hundreds of miles of water, and tiny plankton feed almost every other creature in the sea.

She opened the door, looked left and right, and stepped into the empty street. The lamps were still
on, the shops were closed, and somewhere a dog was barking. She pulled her scarf tighter and started
walking toward the station, counting her steps to keep from thinking about the letter in her pocket.

Music has rhythm, melody, and harmony. A drummer keeps the time, a bass player holds the low notes,
and a singer carries the tune. Some songs are fast and loud; others are slow and soft. People in every
culture sing, dance, and play instruments, from simple flutes to large orchestras.

Question: What is the capital of France? Answer: Paris. Question: How many days are in a week?
Answer: Seven. Question: Which planet is closest to the sun? Answer: Mercury. Question: What do bees
make? Answer: Honey. Question: What color is the sky on a clear day? Answer: Blue.

The user asked the assistant to summarize the report. The assistant replied that sales grew by twelve
percent, costs fell slightly, and the company plans to open two new offices next spring. The user
thanked the assistant and asked for a shorter version, so the assistant wrote a single sentence.

Mountains form when plates of rock push against each other over millions of years. Rain and wind
wear them down again, carrying sand and stone into valleys and rivers. Climbers say the hardest part
of any mountain is not the top but the long walk back down when everyone is tired.

I think, therefore I am. Knowledge is power. Time is money. Practice makes perfect. Actions speak
louder than words. Better late than never. Every cloud has a silver lining. Do not count your chickens
before they hatch. The early bird catches the worm, but the second mouse gets the cheese.

On Monday we fixed the bug in the scheduler; on Tuesday we measured the latency; on Wednesday we wrote
the report. The median request took 42 milliseconds, the slowest one percent took 180 milliseconds,
and throughput reached 1,250 tokens per second on a single machine with eight cores.

Animals adapt to where they live. Camels store fat in their humps and can walk for days without water.
Polar bears have thick fur and a layer of fat to keep them warm. Owls hunt at night with large eyes and
silent wings, while hummingbirds beat their wings so fast that they seem to hang in the air.

The museum opens at nine and closes at five, except on holidays. Tickets cost twelve dollars for
adults and six for children, and students with a card get in free on Fridays. The new exhibition
shows paintings, maps, and tools from ancient trading ports around the world.
"""
