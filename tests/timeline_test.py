"""Tests of planning.timeline: a step's events drawn and written as a trace."""

import json
import os

from matplotlib import image

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate
from lingvo_gpipe.planning import timeline

# K = 2, v = 2: device 0 runs chunks 0 and 2.
EVENTS = [
    simulate.Event(0, 0, 0, schedule.FORWARD, 0.0, 0.001),
    simulate.Event(1, 1, 0, schedule.FORWARD, 0.001, 0.002),
    simulate.Event(0, 2, 0, schedule.FORWARD, 0.002, 0.0035),
]


def testTimeUnitAndLabels():
  assert timeline.TimeUnit(2.0) == (1.0, 's')
  assert timeline.TimeUnit(0.02) == (1e3, 'ms')
  assert timeline.TimeUnit(5e-4) == (1e6, 'us')
  assert timeline.Label(EVENTS[2], chunked=True) == '2.0'
  assert timeline.Label(EVENTS[2], chunked=False) == '0'


def testChromeTraceHasARowPerStageAndMicroseconds(tmp_path):
  path = os.path.join(tmp_path, 'trace.json')
  timeline.WriteChromeTrace(EVENTS, 2, path, 'step')
  with open(path) as f:
    trace = json.load(f)['traceEvents']
  rows = {e['tid']: e['args']['name'] for e in trace
          if e['name'] == 'thread_name'}
  assert rows == {0: 'stage 0', 1: 'stage 1'}
  calls = [(e['name'], e['tid'], round(e['ts']), round(e['dur']))
           for e in trace if e['ph'] == 'X']
  assert calls == [('forward 0.0', 0, 0, 1000), ('forward 1.0', 1, 1000, 1000),
                   ('forward 2.0', 0, 2000, 1500)]


def testDrawTimelineWritesAnImage(tmp_path):
  path = os.path.join(tmp_path, 'timeline.png')
  timeline.DrawTimeline(EVENTS, 2, path, 'K=2 v=2')
  height, width, _ = image.imread(path).shape
  assert width > height > 0
