"""The compile hooks at the top of the pipeline: the torch.compile backend that plans and lowers each
program (`backend.PlanningBackend`) and the offline capture of fake-tensor models (`offline.plan_offline`).
Nothing below imports this package."""
