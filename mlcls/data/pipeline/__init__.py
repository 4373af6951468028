"""The input pipelines (``data.backend``): the torchvision transforms (:mod:`.transforms`), the fast CPU
and device stages (:mod:`.fast`), JPEGs decoded, cropped and resized on the training device (:mod:`.gpu`)
and NVIDIA DALI (:mod:`.dali`): how a sample's image becomes the network's input tensor."""
