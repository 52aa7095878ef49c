"""Lingvo models built on lingvo_gpipe, registered with Lingvo's registry.

Importing this package registers every model: `lm.GPipeCharLm`,
`lm.GPipeCharLmTiny` (params/lm.py) and the image classifiers of
params/image.py.
"""

from params import lm  # pylint: disable=unused-import
