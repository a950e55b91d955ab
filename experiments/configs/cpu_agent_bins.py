"""cpu_agent_bins (`make demo-agent BINS=1`): `make demo-agent` on tool_arithmetic's five
difficulty bins (issue 60), where when to call depends on the model's own skill.

  make demo-agent BINS=1
  python -m launch.train --config=experiments/configs/cpu_agent_bins.py --run_dir=runs/agent_bins

Everything is cpu_agent's (SFT warm start that calls on half the items, then 40 updates of 16
rollouts at a fixed lag of 2, tool price 0.4), but the task: items drawn from five bins in
turn, easy (1 + 1 digits, sum below 10), add1c (1 + 1 with a carry), add2 (2 + 2 digits),
mul21 (2 digits x 1) and hard (3 digits x 2), and every stage evaluation is calibrated
(`eval.calibration`): per bin, the accuracy of answering without calling (also with the
reply begun as a direct answer) beside the tool calls, how well calls follow need, and the
targets of issue 60 (fr_jax.evaluate.TARGETS). After the warm start, a reply begun as a direct
answer scored 0.70 and 0.55 on the two sums and 0.25 or less on the rest
(docs/agent_demo.md).

Hardware: cpu_agent's (2 cores). Time on 2 cores: 22-33 minutes (AMD EPYC, 2026-12-07:
seed 0 1,964 s, of which 40 updates 1,009 s and four calibrated evaluations 576 s; seed 1
1,428 s, the warm start 247 s).
Measured on seeds 0, 1 and 2 (docs/agent_demo.md): after RL it calls on 0.95-1.00 of every
bin, accuracy 1.00; the targets print "met" because no bin ends above 0.9 alone (easy items
0.70-0.90 alone, where it calls anyway), so the rule against needless calls is never tested.
"""

from experiments.configs import cpu_agent


def get_config():
  c = cpu_agent.get_config()
  c.env.kwargs.levels = "easy,add1c,add2,mul21,hard"
  c.eval.calibration = True
  return c
