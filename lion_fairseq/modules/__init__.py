from .decoder_layer import LionDecoderLayer
from .encoder_layer import LionEncoderLayer
from .feature_maps import FEATURE_MAPS
from .lion_attention import VARIANTS, LionAttention, check_lion_options

__all__ = ["FEATURE_MAPS", "VARIANTS", "LionAttention", "LionDecoderLayer", "LionEncoderLayer", "check_lion_options"]
