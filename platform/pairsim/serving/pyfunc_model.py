"""The pyfunc encoder's model file (MLflow's models-from-code): MLflow runs it to get the model,
:class:`~pairsim.serving.pyfunc.EncoderModel`, which loads the export from the model's artifacts."""

import mlflow.models

from pairsim.serving.pyfunc import EncoderModel

mlflow.models.set_model(EncoderModel())
