"""Answer questions about a product manual with the `PromptCache` decorator, in process, on SmolLM2-135M.

The manual (about 1,200 tokens) is the system prompt of every question. The first call computes its KV blocks and
stores them; every later call starts from them and computes only the question, which the printed `cached` counts
show. The last question streams its answer as it is generated. A 135M-parameter model reads a manual only roughly:
the point here is the cache, not the answers.

    .venv/bin/python examples/decorator_qa.py [STORE_FOLDER]

With no folder the store lives in a temporary folder, removed at the end; pass one (e.g. ./prefixgate-store) to keep
the cache warm across runs and processes. Swap `PromptCache.open(...)` for
`PromptCache.connect("http://127.0.0.1:8000")` to ask a running `prefixgate serve` instead: nothing else changes.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from prefixgate.proxy import PromptCache, Reply

MANUAL = """\
You answer questions about the Aurora W2 home weather station, using only the manual below. Answer in one or two
short sentences. If the manual does not say, answer "The manual does not say."

AURORA W2 HOME WEATHER STATION: OWNER'S MANUAL

1. What is in the box
The box holds the indoor display console, the outdoor sensor unit, a mounting pole clamp with two U-bolts, a USB-C
power adapter for the console, four AA batteries for the outdoor sensor, and this manual. The outdoor sensor measures
temperature, humidity, wind speed, wind direction and rainfall. The console shows the readings, stores seven days of
history and connects to your home Wi-Fi network.

2. Setting up the outdoor sensor
Open the battery door on the underside of the sensor with a coin and insert the four AA batteries, matching the
polarity marks. Lithium batteries are recommended below minus 10 degrees Celsius, because alkaline batteries lose
most of their capacity in the cold. The red LED on the front blinks once every 12 seconds while the sensor transmits.
Mount the sensor at least 1.5 metres above the ground, away from walls and roofs that radiate heat, with the arrow
on the top pointing north. The sensor and the console must be within 100 metres of each other in open air; walls
and metal surfaces shorten this range.

3. Setting up the console
Plug the USB-C adapter into the console and a wall socket. The console searches for the outdoor sensor for three
minutes; keep the two within a few metres of each other during this time. When the sensor is found, the antenna
icon stops blinking. If the sensor is not found, press and hold the SEARCH button on the back of the console for
three seconds to search again. The console also keeps its clock on a small CR2032 coin cell, so the time survives a
power cut.

4. Connecting to Wi-Fi
Press and hold the WIFI button for five seconds until the Wi-Fi icon blinks quickly. On your phone, open the Aurora
Home app, tap Add Device and follow the steps. The console works only with 2.4 GHz networks; 5 GHz networks are not
supported. Once connected, the console sets its clock from the internet and uploads readings every five minutes.

5. Reading the display
The top row shows indoor and outdoor temperature. The middle row shows humidity and the wind, with the average speed
over the last two minutes and the strongest gust of the last ten minutes. The bottom row shows rainfall for the last
hour, the last 24 hours and the current week. Press the HISTORY button to step through the highest and lowest values
of each day. Press the UNIT button to switch between Celsius and Fahrenheit, kilometres per hour and miles per hour,
and millimetres and inches.

6. Alarms
Each reading can raise an alarm when it goes above or below a limit you choose. Press ALARM, choose the reading with
the arrow buttons, and set the limit. When an alarm goes off, the console beeps for two minutes and the reading
flashes. Press any button to silence it. The frost alarm is on by default and goes off when the outdoor temperature
falls below 2 degrees Celsius.

7. Cleaning and care
Clean the rain gauge funnel every three months: remove leaves and insects, and rinse the tipping bucket with clean
water. Do not use solvents on the sensor housing. Check the wind cups spin freely after storms. Replace the outdoor
batteries when the battery icon next to the outdoor temperature appears, usually once a year.

8. Resetting the console
A soft reset keeps your settings and history: unplug the console, take out the CR2032 coin cell, wait ten seconds,
and put both back. A factory reset erases all settings, Wi-Fi details and history: press and hold the SEARCH and
ALARM buttons together for ten seconds until the display shows "rSt", then release them. After a factory reset,
set up the Wi-Fi connection again as described in section 4.

9. Troubleshooting
If the outdoor readings show dashes, the console has lost the sensor: check the sensor's batteries, move the console
closer, and press SEARCH. If the rainfall total looks too low, clean the funnel (section 7). If the temperature reads
too high on sunny days, move the sensor into the shade; direct sunlight can add five degrees or more. If the app
shows the console as offline, check that your router still offers a 2.4 GHz network.

10. Specifications
Temperature range outdoors minus 40 to plus 60 degrees Celsius, accuracy 0.5 degrees. Humidity 1 to 99 percent,
accuracy 3 percent. Wind speed 0 to 180 kilometres per hour. Rainfall resolution 0.3 millimetres. Radio frequency
868 MHz in Europe and 915 MHz in North America. Warranty: two years from the date of purchase.
"""

QUESTIONS = [
    "How do I do a factory reset?",
    "Which Wi-Fi networks does the console work with?",
    "How often should I clean the rain gauge?",
]


def main() -> None:
    """Run the questions on the store folder given, or on a temporary one."""
    if len(sys.argv) > 1:
        ask_all(Path(sys.argv[1]))
        return
    with tempfile.TemporaryDirectory(prefix="prefixgate-example-") as folder:
        ask_all(Path(folder))


def ask_all(store: Path) -> None:
    """Ask each question about the manual and print the answer and how much of the prompt came from the cache."""
    with PromptCache.open(model="smollm2-135m", store=store) as cache:

        @cache.cached(max_tokens=40, temperature=0.0)
        def ask(question: str) -> list[dict[str, str]]:
            return [{"role": "system", "content": MANUAL}, {"role": "user", "content": question}]

        for question in QUESTIONS[:-1]:
            started = time.perf_counter()
            reply = ask(question)
            print(f"Q: {question}\nA: {reply.text.strip()}")
            report(reply, time.perf_counter() - started)

        question = QUESTIONS[-1]
        print(f"Q: {question}\nA: ", end="", flush=True)
        started = time.perf_counter()
        stream = ask.stream(question)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        report(stream.reply, time.perf_counter() - started)


def report(reply: Reply, seconds: float) -> None:
    """Print one reply's usage."""
    usage = reply.usage
    print(
        f"   cached {usage.cached_tokens} of {usage.prompt_tokens} prompt tokens, "
        f"{usage.completion_tokens} generated ({reply.finish_reason}), {seconds:.1f} s\n"
    )


if __name__ == "__main__":
    main()
