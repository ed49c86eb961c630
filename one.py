import sys, time
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="x", max_retries=0)
t = time.time(); n = 0
try:
    for ev in c.chat.completions.create(model="m", stream=True, messages=[{"role": "user", "content": "hi"}]): n += 1
    print("complete", n, "events in", round(time.time() - t, 1))
except Exception as e:
    print("broken after", n, "events", round(time.time() - t, 1), type(e).__name__, e)
