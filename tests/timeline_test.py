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


def _Trace(events, path):
  timeline.WriteChromeTrace(events, 2, path, 'step')
  with open(path) as f:
    return [(e['name'], e['tid']) for e in json.load(f)['traceEvents']
            if e['ph'] == 'X']


def testChromeTraceOfAPlacedTable(tmp_path):
  """Each call on the row of its chunk's device, labelled with its chunk."""
  path = os.path.join(tmp_path, 'trace.json')
  v_shape = schedule.TableFromOrders(
      'v-shape', num_devices=2, num_micro_batches=1, virtual_stages=2,
      loss_outside=True, placement=(0, 1, 1, 0),
      orders=[[schedule.Action(schedule.FORWARD, 0, 0),
               schedule.Action(schedule.FORWARD, 3, 0),
               schedule.Action(schedule.BACKWARD, 3, 0),
               schedule.Action(schedule.BACKWARD, 0, 0)],
              [schedule.Action(schedule.FORWARD, 1, 0),
               schedule.Action(schedule.FORWARD, 2, 0),
               schedule.Action(schedule.BACKWARD, 2, 0),
               schedule.Action(schedule.BACKWARD, 1, 0)]])
  v_sim = simulate.Simulate(v_shape, [1.0] * 4, [2.0] * 4, 'never')
  assert _Trace(v_sim.events, path) == [
      ('forward 0.0', 0), ('forward 3.0', 0), ('backward 3.0', 0),
      ('backward 0.0', 0), ('forward 1.0', 1), ('forward 2.0', 1),
      ('backward 2.0', 1), ('backward 1.0', 1)]
  # v = 1, chunks swapped: the labels name the chunk, as they do not for the
  # default placement.
  swapped = schedule.TableFromOrders(
      'swapped', num_devices=2, num_micro_batches=1, virtual_stages=1,
      loss_outside=True, placement=(1, 0),
      orders=[[schedule.Action(schedule.FORWARD, 1, 0),
               schedule.Action(schedule.BACKWARD, 1, 0)],
              [schedule.Action(schedule.FORWARD, 0, 0),
               schedule.Action(schedule.BACKWARD, 0, 0)]])
  sim = simulate.Simulate(swapped, [1.0] * 2, [2.0] * 2, 'never')
  assert _Trace(sim.events, path) == [
      ('forward 1.0', 0), ('backward 1.0', 0), ('forward 0.0', 1),
      ('backward 0.0', 1)]
  sim = simulate.Simulate(schedule.BuildTable('gpipe', 2, 1), [1.0] * 2,
                          [2.0] * 2, 'never')
  assert _Trace(sim.events, path) == [
      ('forward 0', 0), ('backward 0', 0), ('forward 0', 1),
      ('backward 0', 1)]
  timeline.DrawTimeline(v_sim.events, 2, os.path.join(tmp_path, 'v.png'),
                        'V-shaped')
