"""Lingvo models built on lingvo_gpipe, registered with Lingvo's registry.

Importing this package registers every model: `lm.GPipeCharLm`,
`lm.GPipeCharLmTiny` (params/lm.py), `image.ShapesResNet` and
`image.ShapesResNetTiny` (params/image.py), `mt.ReverseTransformer` and
`mt.ReverseTransformerTiny` (params/mt.py, Lingvo's
GPipeTransformerStack through lingvo_gpipe.stacks).
"""

from params import image  # pylint: disable=unused-import
from params import lm  # pylint: disable=unused-import
from params import mt  # pylint: disable=unused-import
