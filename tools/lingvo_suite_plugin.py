"""A pytest plugin that runs Lingvo's own tests on lingvo_gpipe's drop-ins.

Loaded by `tools/lingvo_suite.py` (`pytest -p tools.lingvo_suite_plugin`).
Before pytest imports a test module it

* parses absl flags (Lingvo reads them at layer construction; its tests set
  `tf.flags.FLAGS.tpu_compatible`), as `test_utils.main` would;
* unless LINGVO_SUITE_REFERENCE=1, puts our classes where Lingvo's tests
  import theirs from (`SwapInDropIns`): `lingvo.core.gpipe.PipeliningLayer`
  and the stacks of `lingvo.core.layers_with_gpipe` become those of
  `lingvo_gpipe.stacks`, as a user who swaps one import would have them.

Lingvo's cells (`FeatureExtractionLayer`, the Transformer layers) stay
Lingvo's: only the pipeline under them changes.
"""

import os
from typing import Dict

# The classes Lingvo's tests import, by module, and ours in their place.
DROP_INS = {
    'lingvo.core.gpipe': ('PipeliningLayer',),
    'lingvo.core.layers_with_gpipe': ('PipeliningLayer',
                                      'GPipeTransformerStack',
                                      'GPipeEvolvedTransformerStack',
                                      'GPipeBatchMajorTransformerStack'),
}


def SwapInDropIns() -> Dict[str, str]:
  """Replaces Lingvo's pipeline classes in their modules by ours.

  Our classes subclass Lingvo's, so they are imported (and bound to Lingvo's
  originals) before the module attributes change.

  Returns:
    {'module.Name': 'our module.Name'} for every class replaced.
  """
  import importlib  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import stacks  # pylint: disable=g-import-not-at-top
  swapped = {}
  for module_name, names in DROP_INS.items():
    module = importlib.import_module(module_name)
    for name in names:
      ours = getattr(stacks, name)
      setattr(module, name, ours)
      swapped[f'{module_name}.{name}'] = f'{ours.__module__}.{ours.__name__}'
  return swapped


def pytest_configure(config):
  """Parses absl flags and swaps in the drop-ins before any test imports."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top,unused-import
  flags.FLAGS(['lingvo_suite'], known_only=True)
  if os.environ.get('LINGVO_SUITE_REFERENCE') == '1':
    config.lingvo_suite_swapped = {}
  else:
    config.lingvo_suite_swapped = SwapInDropIns()


def pytest_report_header(config):
  swapped = getattr(config, 'lingvo_suite_swapped', {})
  if not swapped:
    return "lingvo_suite: Lingvo's own classes (reference run)"
  return ['lingvo_suite: drop-ins swapped in:'] + [
      f'  {lingvo} -> {ours}' for lingvo, ours in swapped.items()
  ]


def pytest_collection_modifyitems(config, items):
  """Leaves out tf.test.TestCase.test_session, a helper, not a Lingvo case."""
  kept = [item for item in items if item.name != 'test_session']
  if len(kept) != len(items):
    config.hook.pytest_deselected(
        items=[item for item in items if item.name == 'test_session'])
    items[:] = kept
