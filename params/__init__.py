"""Lingvo models built on lingvo_gpipe, registered with Lingvo's registry.

Importing this package registers every model: `lm.GPipeCharLm`,
`lm.GPipeCharLmTiny` (params/lm.py), `image.ShapesResNet`,
`image.ShapesResNetTiny`, `image.ShapesUNet` and `image.ShapesUNetTiny`
(params/image.py; the U-Net has skip connections across stages),
`mt.ReverseTransformer` and `mt.ReverseTransformerTiny` (params/mt.py,
Lingvo's GPipeTransformerStack through lingvo_gpipe.stacks).
"""

from params import image  # pylint: disable=unused-import
from params import lm  # pylint: disable=unused-import
from params import mt  # pylint: disable=unused-import
