"""Cryo-EM particle data for the denoising CNN: one import for :mod:`jaxgrad.cnn.mrc` (reading and writing MRC
stacks) and :mod:`jaxgrad.cnn.stream` (shuffled, memory-bounded batch streams and per-particle normalisation).
"""

from jaxgrad.cnn.mrc import (SUPPORTED_MODES, ArrayStack, MRCFormatError, MRCStack, open_stack, stack_writer,
                             write_stack)
from jaxgrad.cnn.stream import ParticleStream, normalize_per_particle

__all__ = ["SUPPORTED_MODES", "ArrayStack", "MRCFormatError", "MRCStack", "ParticleStream", "normalize_per_particle",
           "open_stack", "stack_writer", "write_stack"]
