"""The input pipelines (``data.backend``): the torchvision transforms (:mod:`.transforms`), the fast CPU
and device stages (:mod:`.fast`) and NVIDIA DALI (:mod:`.dali`): how a sample's image becomes the network's
input tensor."""
