"""MLflow "models from code" entry of the agentrl policy: MLflow copies this file into the logged model and runs it at
load time, instead of unpickling a Python object (no pickled code in the artefact; mlflow.org, "Models From Code").
The class itself lives in the installed package: :class:`pipeline.deploy.pyfunc.AgentPolicyModel`."""

import mlflow.models

from pipeline.deploy.pyfunc import AgentPolicyModel

mlflow.models.set_model(AgentPolicyModel())
