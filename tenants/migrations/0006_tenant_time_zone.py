
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0005_tenant_hosted_tools'),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='time_zone',
            field=models.CharField(default='UTC', max_length=64),
        ),
    ]
